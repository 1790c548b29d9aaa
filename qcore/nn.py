"""torch modules over quantized weights.

`Linear` is a linear layer whose weight is a qcore QTensor: its `weight` parameter holds the
portable payload (docs/spec.md, portable bytes) as a 1-D uint8 tensor, exactly what a qcore file
stores under the weight's name, so `state_dict()` and transformers' loader move the bytes as they
are; `forward` calls the backend's `linear` (docs/spec.md, products with a quantized weight) with
the caller's torch tensors. `quantize_module` swaps a model's `torch.nn.Linear` layers in place by
a recipe, choosing each weight's scheme as `qcore quantize` does for the same tensor name.

    import qcore.nn
    qcore.nn.quantize_module(model, "q4s/block32:f16")   # every Linear but the kept ones
    model(input_ids)

The weight is inference-only: gradients flow to the input (and the bias), never into the codes.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from qcore.backend.activations import torch_dtype_as_numpy
from qcore.errors import InputError
from qcore.spec.payload import QuantizedData, sections
from qcore.backend.protocol import Backend, QTensor
from qcore.model.recipe import RecipeLike, as_recipe
from qcore.backend.registry import AutoBackend, backend as get_backend
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = ["Linear", "quantize_module", "quantized_linears", "backend_for"]


def backend_for(scheme: QuantScheme, device: torch.device, backend: str | Backend | None = None) -> Backend:
    """The backend that runs a weight held on `device`: `backend` if given; else for a CUDA device
    the `cuda` backend, and for the CPU the highest-priority available host backend that supports
    `scheme` (`AutoBackend.pick` among backends whose `device` is "cpu")."""
    if isinstance(backend, Backend):
        return backend
    if backend is not None and backend != "auto":
        return get_backend(backend)
    return AutoBackend().pick(scheme, device=device.type)


class _LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b through the backend's `linear`; the backward gives x (and b) their gradients
    through the backend's `matmul` (W [N, K] read as the [K, N] of g @ W), never W's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: "Linear") -> torch.Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return layer.qweight.backend.linear(x, layer.qweight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        layer: Linear = ctx.layer
        grad_x = layer.qweight.backend.matmul(grad.contiguous(), layer.qweight, dtype=grad.dtype) \
            if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_x, grad_b, None


class Linear(torch.nn.Module):
    """A linear layer y = x @ W^T + b whose weight W [out_features, in_features] is quantized.

    `weight` is the portable payload as a uint8 parameter (no gradient); `scheme` its scheme.
    The QTensor the backend computes with (`qweight`) is made from those bytes on first use and
    again whenever they change or move (`module.to("cuda")` moves the bytes; the next call reads
    them on the cuda backend). On a GPU the QTensor reads the parameter's memory in place (the
    cuda backend's `adopt`), so the payload is held once on the device.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme | str, bias: bool = True, *,
                 backend: str | Backend | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.scheme = parse_scheme(scheme)
        size = sections((self.out_features, self.in_features), self.scheme).total
        self.weight = torch.nn.Parameter(torch.zeros(size, dtype=torch.uint8, device=device), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)) if bias else None
        self.backend = backend
        self._bound: tuple[Any, QTensor] | None = None

    @classmethod
    def from_qtensor(cls, weight: QTensor, bias: torch.Tensor | None = None, *,
                     backend: str | Backend | None = None) -> "Linear":
        """A layer over the quantized weight [out, in] (its bytes copied into `weight`) and an
        optional float bias [out]."""
        if not isinstance(weight, QTensor):
            raise InputError(f"Linear.from_qtensor takes a QTensor weight, got {type(weight).__name__}")
        if weight.ndim != 2:
            raise InputError(f"a Linear weight is 2-D [out_features, in_features], got shape {weight.shape}")
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, weight.scheme, bias is not None, backend=backend,
                    dtype=bias.dtype if bias is not None else None)
        payload = np.frombuffer(weight.to_data().payload, dtype=np.uint8)
        layer.weight.data.copy_(torch.from_numpy(payload.copy()))
        if bias is not None:
            if tuple(bias.shape) != (out_f,):
                raise InputError(f"bias has shape {tuple(bias.shape)}; this layer has {out_f} output features")
            layer.bias.data.copy_(bias.detach())
        layer._bound = (layer._key(), weight)  # the caller's QTensor is what the bytes say
        return layer

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, scheme: QuantScheme | str, *,
                    backend: str | Backend | None = None) -> "Linear":
        """Quantize a `torch.nn.Linear`'s weight to `scheme` (on its device's backend) and keep its bias."""
        sch = parse_scheme(scheme)
        w = linear.weight.detach()
        q = backend_for(sch, w.device, backend).quantize(w if w.device.type == "cpu" else w.cpu(), sch)
        layer = cls.from_qtensor(q, linear.bias, backend=backend)
        return layer.to(w.device)

    # ------------------------------------------------------------------ the quantized weight
    def _key(self) -> tuple[Any, ...]:
        w = self.weight
        return (w.device, w.data_ptr(), w._version)

    @property
    def qweight(self) -> QTensor:
        """The weight as a QTensor on the backend for the bytes' device (made again when the bytes
        change or move). Invalid payload bytes are an `InvalidDataError` naming the rule."""
        key = self._key()
        if self._bound is None or self._bound[0] != key:
            be = backend_for(self.scheme, self.weight.device, self.backend)
            raw = self.weight.detach()
            payload = (raw if raw.device.type == "cpu" else raw.cpu()).numpy().tobytes()
            data = QuantizedData((self.out_features, self.in_features), self.scheme, payload)
            # a device backend reads the parameter in place (`Backend.adopt`): one copy on the GPU
            self._bound = (key, be.adopt(data, raw) if raw.device.type != "cpu" else be.from_data(data))
        return self._bound[1]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] decoded (docs/spec.md, dequantize) as a torch tensor of `dtype`, on the
        weight's device."""
        return self.qweight.dequantize(dtype).to(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(x, self.bias, self)

    def extra_repr(self) -> str:
        be = self.backend if isinstance(self.backend, str) else getattr(self.backend, "name", "auto")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme='{self.scheme}', backend={be or 'auto'}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._bound = None  # new bytes: bind again on next use


def quantized_linears(model: torch.nn.Module) -> Iterator[tuple[str, Linear]]:
    """(name, layer) of every qcore `Linear` in `model`."""
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            yield name, mod


def quantize_module(model: torch.nn.Module, recipe: RecipeLike = None, *, rules: Sequence[str] = (),
                    backend: str | Backend | None = None) -> dict[str, QuantScheme | str]:
    """Replace `model`'s `torch.nn.Linear` layers in place by qcore `Linear`s, each weight's scheme
    chosen by `recipe` (and `rules`) for the name `LAYER.weight`, as `qcore quantize` chooses for
    that tensor in a checkpoint (so the bytes equal the CLI's for the same weights). Returns
    {weight name: scheme, or the reason it was kept}."""
    rc = as_recipe(recipe, rules=rules)
    if not rc.schemes():
        raise InputError("the recipe quantizes nothing: give a scheme (e.g. 'q8s') or rules PATTERN=SCHEME")
    decided: dict[str, QuantScheme | str] = {}
    layers = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, layer in layers:
        wname = f"{name}.weight"
        w = layer.weight
        d = rc.decide(wname, tuple(w.shape), torch_dtype_as_numpy(w.dtype))
        if d.scheme is None:
            decided[wname] = d.reason
            continue
        model.set_submodule(name, Linear.from_linear(layer, d.scheme, backend=backend))
        decided[wname] = d.scheme
    return decided

