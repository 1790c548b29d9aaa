"""Load, run and save qcore checkpoints with transformers' `from_pretrained`.

Importing this module registers the quantization method `qcore` with transformers' public
registration API (`register_quantization_config`, `register_quantizer`), the way bitsandbytes,
torchao, quanto and HQQ integrate:

    import qcore.integrations.transformers  # noqa: F401  (registers "qcore")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("llama-q4")   # a `qcore quantize` output folder
    model.generate(...)
    model.save_pretrained("llama-q4-again")                    # the same qcore files

A folder is a qcore checkpoint when its config.json has a `quantization_config` with
`quant_method: "qcore"` (`qcore.files.hfconfig`; `qcore quantize` writes it). Loading
replaces each quantized `torch.nn.Linear` by `qcore.nn.Linear` before the weights are read, so
transformers moves the payload bytes into it as they are; its forward calls the backend's
`linear` on the weight's device (the cuda backend on a GPU; on the CPU the highest-priority host
backend that supports the scheme; `$QCORE_BACKEND` or `QcoreConfig(backend=...)` chooses
another). A quantized tensor of another kind of module (an embedding, say) is decoded once, after
loading, into that module's float parameter; its bytes are kept for saving. Tensors the
checkpoint keeps in float are transformers' as usual.

`from_pretrained(plain_folder, quantization_config=QcoreConfig(recipe="q4s/block32:f16"))`
quantizes a float checkpoint while loading it, by the same recipe rules as `qcore quantize`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from qcore.files import io as qio
from qcore.backend.activations import torch_dtype_as_numpy
from qcore.files.checkpoint import resolve
from qcore.errors import InvalidDataError
from qcore.nn import Linear, backend_for, quantize_module, quantized_linears
from qcore.spec.payload import QuantizedData, sections
from qcore.model.recipe import RecipeLike, as_recipe
from qcore.spec.schemes import QuantScheme
from qcore.files.stfile import st_dtype
from qcore.files.hfconfig import QUANT_METHOD, quantization_config, tensor_schemes

__all__ = ["QcoreConfig", "QcoreHfQuantizer", "QUANT_METHOD"]


@register_quantization_config(QUANT_METHOD)
class QcoreConfig(QuantizationConfigMixin):
    """transformers' view of a qcore `quantization_config` (`qcore.files.hfconfig`).

    `tensors` maps each quantized tensor's name to its scheme (a qcore checkpoint's); `recipe`
    (scheme text, a recipe dict or a .toml path) quantizes a float checkpoint while loading it;
    `backend` names the qcore backend to run on (None: `$QCORE_BACKEND`, else chosen per device
    and scheme). Only `format_version`, `recipe` and `tensors` are written to config.json.
    """

    def __init__(self, recipe: RecipeLike = None, tensors: Mapping[str, str] | None = None,
                 format_version: str = qio.FORMAT_VERSION, backend: str | None = None, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        # checked first: the version this qcore reads, tensor names -> scheme texts that parse
        tensor_schemes({"format_version": format_version, "tensors": {} if tensors is None else tensors},
                       "quantization_config")
        self.format_version = format_version
        self.recipe = as_recipe(recipe).to_dict() if recipe is not None else None
        self.tensors = dict(tensors or {})
        self.backend = backend or os.environ.get("QCORE_BACKEND") or None

    def schemes(self) -> dict[str, QuantScheme]:
        """{tensor name: scheme} of the checkpoint."""
        return tensor_schemes(self.to_dict(), "quantization_config")

    def to_dict(self) -> dict[str, Any]:
        return quantization_config(self.tensors, self.recipe)

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()


def _numpy_payload(t: torch.Tensor) -> bytes:
    return (t.detach() if t.device.type == "cpu" else t.detach().cpu()).numpy().tobytes()


@register_quantizer(QUANT_METHOD)
class QcoreHfQuantizer(HfQuantizer):
    """Shapes a model for a qcore checkpoint before transformers loads it, binds the loaded bytes
    after, and hands `save_pretrained` the qcore file metadata."""

    requires_calibration = False
    quantization_config: QcoreConfig

    def __init__(self, quantization_config: QcoreConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._decoded: dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype]] = {}

    # ------------------------------------------------------------------ before loading
    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, Mapping) and "disk" in device_map.values():
            raise ValueError("qcore layers cannot be offloaded to disk; use a device_map without 'disk'")
        if not self.pre_quantized and self.quantization_config.recipe is None:
            raise ValueError("QcoreConfig needs a recipe to quantize a float checkpoint while loading it, "
                             "e.g. QcoreConfig(recipe='q4s/block32:f16')")

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        if not self.pre_quantized:
            return
        for name, sch in self.quantization_config.schemes().items():
            owner, _, param = name.rpartition(".")
            try:
                module = model.get_submodule(owner)
                current = getattr(module, param)
            except AttributeError:
                raise InvalidDataError(f"quantization_config names tensor '{name}', which this model "
                                       f"({type(model).__name__}) does not have") from None
            if not isinstance(current, torch.Tensor):
                raise InvalidDataError(f"quantization_config names '{name}', which is not a tensor of this model")
            shape = tuple(current.shape)
            size = sections(shape, sch).total
            if type(module) is torch.nn.Linear and param == "weight":
                layer = Linear(module.in_features, module.out_features, sch, module.bias is not None,
                               backend=self.quantization_config.backend, device="meta",
                               dtype=module.bias.dtype if module.bias is not None else None)
                model.set_submodule(owner, layer)
            else:  # held as bytes while loading, decoded into the module's float tensor after
                self._decoded[name] = (torch.empty(0), shape, current.dtype)
                setattr(module, param, torch.nn.Parameter(torch.empty(size, dtype=torch.uint8, device="meta"),
                                                          requires_grad=False))

    # ------------------------------------------------------------------ after loading
    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        if not self.pre_quantized:
            decided = quantize_module(model, self.quantization_config.recipe, backend=self.quantization_config.backend)
            self.quantization_config.tensors = {n: str(s) for n, s in decided.items() if isinstance(s, QuantScheme)}
        schemes = self.quantization_config.schemes()
        for name, (_, shape, dtype) in list(self._decoded.items()):
            owner, _, param = name.rpartition(".")
            module = model.get_submodule(owner)
            payload = getattr(module, param).detach()
            be = backend_for(schemes[name], payload.device, self.quantization_config.backend)
            q = be.from_data(QuantizedData(shape, schemes[name], _numpy_payload(payload)))
            decoded = q.dequantize(dtype).to(payload.device)
            setattr(module, param, torch.nn.Parameter(decoded, requires_grad=False))
            self._decoded[name] = (payload, shape, dtype)
        for _, layer in quantized_linears(model):
            layer.qweight  # noqa: B018 - bind now: a bad payload fails the load, not the first forward
        model.save_pretrained = _QcoreSave(model)  # the files' qcore metadata, shard by shard

    # ------------------------------------------------------------------ saving
    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    def get_state_dict_and_metadata(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor] | None, dict]:
        """The state dict with the decoded tensors' payloads back in place, and the qcore header
        keys of every quantized tensor (`_QcoreSave` keeps each shard's own)."""
        state = model.state_dict()
        for name, (payload, _, _) in self._decoded.items():
            state[name] = payload
        meta = qio.qcore_header({}, as_recipe(self.quantization_config.recipe).to_json()
                                if self.quantization_config.recipe is not None else None)
        float_dtype = _st_dtype(_float_dtype(model))
        for name, sch in self.quantization_config.schemes().items():
            if name in self._decoded:
                _, shape, dtype = self._decoded[name]
                meta.update(qio.quantized_keys(name, sch, shape, _st_dtype(dtype)))
            else:
                layer = model.get_submodule(name.rpartition(".")[0])
                meta.update(qio.quantized_keys(name, sch, (layer.out_features, layer.in_features), float_dtype))
        return state, meta

    def _dequantize(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Every qcore layer back to a `torch.nn.Linear` with the decoded weight (in `dtype`, a
        torch dtype or its name, else the model's)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            dtype = _float_dtype(model)
        for name, layer in list(quantized_linears(model)):
            plain = torch.nn.Linear(layer.in_features, layer.out_features, layer.bias is not None,
                                    device=layer.weight.device, dtype=dtype)
            plain.weight.data.copy_(layer.dequantized_weight(dtype))
            if layer.bias is not None:
                plain.bias.data.copy_(layer.bias.detach())
            model.set_submodule(name, plain)
        self._decoded.clear()
        return model


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


def _st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch float dtype, recorded as the source dtype a later
    `qcore dequantize` restores."""
    return st_dtype(torch_dtype_as_numpy(dtype))


class _QcoreSave:
    """`model.save_pretrained` for a qcore model: transformers writes the files, then each
    safetensors shard keeps only its own tensors' qcore keys, in sorted order
    (`qcore.files.io.settle_metadata`), so every shard is a valid qcore file and equal models give
    equal bytes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        out = type(self._model).save_pretrained(self._model, save_directory, *args, **kwargs)
        for path in _written_shards(os.fspath(save_directory)):
            qio.settle_metadata(path)
        return out


def _written_shards(folder: str) -> list[str]:
    """The safetensors files of the checkpoint `save_pretrained` wrote in `folder` (its index's
    shards, or its one file), as `qcore.files.checkpoint.resolve` finds them."""
    ck = resolve(folder)
    return [ck.path(s) for s in ck.shards]
