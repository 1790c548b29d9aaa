"""Integrations with the stacks that run models.

- `qcore.integrations.transformers`: `from_pretrained` of a qcore checkpoint folder (needs
  torch and transformers; importing it registers the `qcore` quantization method).
- `qcore.integrations.config`: the `quantization_config` entry of a model folder's config.json
  that marks a qcore checkpoint (plain Python; `qcore quantize` writes it).
"""
