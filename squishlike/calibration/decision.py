"""What calibration decided (`Plan`), for compress to apply as it writes each tensor: AWQ's rewrites, the widths
a size target or mixed precision chose, and GPTQ's rounding on each linear's calibration inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..npydir import NpyDir, TensorEntry
from ..quant.reference import from_float32, to_float32
from .awq import Transform
from .gptq import expert_factors, gptq, inverse_hessian_factor
from .quantizer import Quantizer
from .rounding import refit

GPTQ_REASON = "; GPTQ (rounding errors compensated on the calibration inputs)"  # ends a GPTQ'd tensor's reason
REFIT_REASON = ", its grid then refitted to them (scales and offsets by least squares)"
GPTQ_EXPERTS_REASON = "; GPTQ per expert (each expert's rounding errors compensated on the rows routed to it)"
# The token embedding's input groups (calibration/lookup.py): an untied one's, and a tied one's (the head's inputs
# and the lookup's Hessian together)
LOOKUP_GROUP, TIED_GROUP = "lookup", "head+lookup"
_LOOKUP = "what reads a looked-up row in the first layer (its linears through their norm, and the residual path)"
GPTQ_REASONS = {LOOKUP_GROUP: f"; GPTQ along its width (rounding errors compensated on the Hessian of {_LOOKUP})",
                TIED_GROUP: f"{GPTQ_REASON[:-1]}, and on the Hessian of {_LOOKUP})"}


@dataclass
class Plan:
    """What calibration decided, for `compress` to apply as it streams the tensors."""

    transform: Transform = field(default_factory=Transform)
    promote: dict[str, str] = field(default_factory=dict)  # name -> scheme
    group_sizes: dict[str, int] = field(default_factory=dict)  # name -> the group size planned with its scheme
    promoted_by: str = "mixed precision"  # what chose the schemes of `promote`, for the manifest's reasons
    reference_ppl: float | None = None
    record: dict[str, Any] = field(default_factory=dict)  # manifest keys
    runtime: str = "float32"  # the store's runtime dtype
    # linear -> (its input group, the group's calibration inputs, for an expert stack the expert of each row), for GPTQ
    inputs: dict[str, tuple[str, np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    quantizers: dict[str, Quantizer] = field(default_factory=dict)  # linear -> the store's quantizer, for GPTQ
    refit_scales: bool = False  # GPTQ's grid refitted to its codes on the output error (rounding.py)
    # The store another size's widths were planned from (`sensitivity_from`), and its entries of the tensors it
    # holds as this compress writes them (`Calibrator._unchanged`): compress copies their parts.
    earlier: NpyDir | None = None
    unchanged: dict[str, TensorEntry] = field(default_factory=dict)
    # The latest group's inverse-Hessian factor (an expert stack's: one per expert), shared by the linears that read
    # one input (q, k, v; gate, up), which compress reaches one after another; keyed by the group and the AWQ scale
    # its inputs were divided by. Only one is kept: a wide one (down's) is hundreds of MB.
    _factor: tuple[tuple[str, int], list] | None = field(default=None, init=False, repr=False)

    def apply(self, name: str, array: np.ndarray, src_dtype: str, scheme: str) -> tuple[np.ndarray, str]:
        """The tensor as the store should hold it (float32 when rewritten), and its dtype name; `scheme`: the
        store's for it (`scheme`'s answer). An exact tensor whose values the plan chose, kept exact by mixed
        precision or rewritten (a folded norm or bias), is held in the runtime dtype: what every load casts it to,
        and what the budget counted; an untouched one stays as the source holds it."""
        rewritten = self.rewrites(name)
        if rewritten:
            array, src_dtype = self.transform.apply(name, to_float32(array, src_dtype)), "float32"
        if scheme == "passthrough" and (rewritten or self.promote.get(name) == "passthrough") \
                and src_dtype != self.runtime:
            array, src_dtype = from_float32(to_float32(array, src_dtype), self.runtime), self.runtime
        return array, src_dtype

    def quantize(self, name: str, array: np.ndarray, src_dtype: str, scheme: str) -> tuple[np.ndarray, ...] | None:
        """The parts of `name` (as `apply` returned it) quantized by GPTQ on its calibration inputs, when GPTQ was
        asked for and the tensor keeps the store's scheme; else None (compress rounds it to nearest). An expert
        stack ([experts, out, in]) is GPTQ'd expert by expert, each on its own Hessian (`expert_factors`)."""
        if not self.compensates(name, scheme):
            return None
        qz = self.quantizers[name]
        group, x, experts = self.inputs[name]
        scale = self.transform.col.get(name)
        if scale is not None:  # AWQ multiplied the weight's columns by s: its inputs are divided by s
            x = x / scale[None, :]
        if self._factor is None or self._factor[0] != (group, id(scale)):
            factor = inverse_hessian_factor(x) if experts is None else expert_factors(x, experts, array.shape[0])
            self._factor = (group, id(scale)), factor
        if experts is None:
            w = array.reshape(-1, array.shape[-1])  # a per-head stack's heads share the Hessian
            parts = gptq(w, src_dtype, qz, self._factor[1])
            return self._refit(name, to_float32(w, src_dtype), x, qz, parts) if self.refit_scales else parts
        parts = [gptq(array[e], src_dtype, qz, f) for e, f in enumerate(self._factor[1])]
        return tuple(np.concatenate(p) for p in zip(*parts))

    def _refit(self, name: str, w: np.ndarray, x: np.ndarray, qz: Quantizer,
               parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """GPTQ's `parts` of `name` with their grid refitted (rounding.py); both output errors into the record."""
        parts, errors = refit(np.asarray(w, np.float32), x, qz, parts)
        found = self.record.setdefault("scale_refit", {}).setdefault("tensors", {})
        found[name] = {k: float(f"{v:.6g}") for k, v in errors.items()}
        return parts

    def compensation(self, name: str) -> str:
        """What ends the manifest reason of a tensor `quantize` GPTQs."""
        group, _, experts = self.inputs[name]
        if experts is not None:
            return GPTQ_EXPERTS_REASON
        errors = self.record.get("scale_refit", {}).get("tensors", {}).get(name)
        return GPTQ_REASONS.get(group, GPTQ_REASON) + (REFIT_REASON if errors and errors["refit"] < errors["gptq"]
                                                        else "")

    def compensates(self, name: str, scheme: str) -> bool:
        """Whether `quantize` GPTQs `name` at `scheme` (it has the inputs and the quantizer of that scheme)."""
        qz = self.quantizers.get(name)
        return qz is not None and name in self.inputs and scheme == qz.scheme

    def unchanged_parts(self, name: str) -> tuple[TensorEntry, dict[str, np.ndarray]] | None:
        """The entry and parts of `name` in the store the widths were planned from, when it holds `name` as this
        compress would write it (`unchanged`); else None."""
        entry = self.unchanged.get(name)
        if entry is None:
            return None
        return entry, {suffix: self.earlier.load_part(name, suffix) for suffix in entry.kind.suffixes}

    def rewrites(self, name: str) -> bool:
        """Whether `apply` changes the values of `name` (AWQ scaling): a source's own quantized values then no
        longer hold them."""
        return self.transform.touches(name)

    def group_size(self, name: str, default: int) -> int:
        """The group size `name` is stored with: the one planned with its width, else `default` (the store's)."""
        return self.group_sizes.get(name, default)

    def sized(self, name: str) -> bool:
        """Whether a size target (bits per weight) planned the width of `name`."""
        return name in self.promote and "bpw" in self.record

    def scheme(self, name: str, scheme: str, reason: str) -> tuple[str, str]:
        if scheme != "passthrough" and name in self.promote:
            kept = self.promote[name]
            what = "exact (runtime dtype)" if kept == "passthrough" else f"at {kept}"
            return kept, f"{self.promoted_by}: kept {what} (measured sensitivity)"
        return scheme, reason
