"""Integrations with the stacks that run models.

- `qcore.integrations.transformers`: `from_pretrained` of a qcore checkpoint folder (needs
  torch and transformers; importing it registers the `qcore` quantization method). The
  `quantization_config` entry of config.json it reads is `qcore.files.hfconfig`'s.
"""
