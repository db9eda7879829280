"""What `compress` is asked to do (`CompressOptions`) and the rules it decides by: the runtime dtype of a store
and the scheme of each tensor. Calibration reads the same rules to know what compress will do with a tensor."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .dtypes import NP_STORAGE
from .provider import WeightProvider
from .quant.schemes import SCHEMES, WIDTHS

if TYPE_CHECKING:
    import mlx.nn as nn

SCHEMES_OFFERED = ("int8", "int4", "int3")  # the uniform points compress offers (CompressOptions.scheme)
ROW = "row"  # --group-size for INT8's per-row symmetric form (scheme "int8"); a number picks group-wise "int8g"
# The group sizes compress offers. INT3 offers only the sizes its accuracy gate is specified for, though its
# kernels (like mx.quantize) also take 128.
GROUP_SIZES = {"int8": (*SCHEMES["int8g"].group_sizes, ROW), "int4": SCHEMES["int4"].group_sizes, "int3": (32, 64)}
# Schemes whose embedding and output head are quantized by default, as mlx_lm.convert -q does at those bits; an
# INT3 store keeps them exact (3-bit ones fail its accuracy gate).
EMBEDDINGS_QUANTIZED_BY_DEFAULT = ("int8", "int4")
# Schemes compressed by default with AWQ, GPTQ and clip search (each --no-X turns one off): at the bytes of
# mlx_lm.convert -q --q-bits 4, 0.42x its mean KL on SmolLM2 (benchmarks/README.md). INT8 needs none of them.
CALIBRATED_BY_DEFAULT = ("int4",)
ALL_TIERS = ("mlx", "finalized", "int8", "int4", "int3")
# The cache tier that holds each quantized scheme natively (every group-wise tensor of a store of that scheme or
# holding that scheme, at its own width); a store's default policy is mlx plus these (default_tiers).
NATIVE_TIERS = {"int8g": "int8", "int4": "int4", "int3": "int3"}
QUANTIZED_TIERS = tuple(NATIVE_TIERS.values())
# A tensor whose sampled relative error exceeds its scheme's limit is an outlier: kept exact (docs/format.md §5).
# About twice the largest error of SmolLM2's tensors at that width (groups of 64; int5 0.055, int6 0.027); 2 bits
# err 0.37-0.55 on every tensor, so its limit only catches a tensor rounded worse than zeroing it nearly would.
ERROR_LIMITS = {"int8": 0.05, "int8g": 0.05, "int6": 0.06, "int5": 0.12, "int4": 0.25, "int3": 0.45, "int2": 0.9}
BPW_RANGE = (2.0, 16.0)
# The rotations compress offers (calibration/rotate.py), fused into the weights before anything is measured or
# rounded: none, random Hadamards of the residual stream and of each head's values, or of each head's values alone
ROTATIONS = ("none", "hadamard", "heads")
DISTILL_SAMPLE_TOKENS = 256  # tokens of one distillation sample (calibration/distill.py): one a step, one held out


@dataclass
class CompressOptions:
    scheme: str | None = None  # one of SCHEMES_OFFERED; with group_size it names the stored scheme (`stored_scheme`).
    # None: int8, or int4 (the width of tensors a bits-per-weight target does not plan) with bpw
    group_size: int | str = 64  # a number, or ROW for INT8's per-row form
    passthrough: tuple[str, ...] = ()  # fnmatch patterns of canonical names kept exact
    # (fnmatch pattern of canonical names, bits in WIDTHS[, group size]) rules, the first that matches a tensor the
    # store quantizes anyway giving its width and group size (the store's when left out; mlx_lm-style mixed
    # recipes: ("*.ffn.down.*", 6), ("layers.1[0-9].*", 3, 128))
    bits: tuple[tuple, ...] = ()
    quantize_embeddings: bool | None = None  # None: for EMBEDDINGS_QUANTIZED_BY_DEFAULT schemes
    clip_search: bool | None = None  # None: on for CALIBRATED_BY_DEFAULT schemes (as awq and gptq)
    dtype: str | None = None  # runtime dtype; default: the source's float dtype, bfloat16 for quantized sources
    tiers: tuple[str, ...] | None = None  # cache policy; default: mlx + the store's quantized tier
    force: bool = False
    extra_manifest: dict = field(default_factory=dict)
    # Calibration (squishlike/calibration/; each runs the source model in float32 on data/calibration.txt):
    awq: bool | None = None  # activation-aware per-input-channel scaling, folded into norms / v / up
    gptq: bool | None = None  # error-compensating rounding of the linears and the head (group-wise schemes)
    refit_scales: bool = False  # GPTQ's grid refitted to its codes on the output error (calibration/rounding.py)
    # GPTQ of the token embedding along its width, on the Hessian of what reads a looked-up row in the first layer
    # (calibration/lookup.py): an untied embedding (`gptq_embedding`; the residual path's part chosen by what each
    # choice's rounding costs at the output, measured); a tied one with it added to the head's, each weighed by what
    # an error in its rows costs at the output, measured (`gptq_tied_lookup`; docs/design.md §7.5).
    # None: as gptq
    gptq_embedding: bool | None = None
    gptq_tied_lookup: bool | None = None
    mixed_precision: float = 0.0  # keep the most sensitive tensors at INT8 (INT4/INT3) or exact (INT8) within this
    # extra-size fraction of the quantized tensors' bytes
    int3_gate: bool = True  # INT3: measure the accuracy gate at compress time (docs/format.md §6.4)
    int3_max_ppl_increase: float = 0.08  # INT3: the gate's bound on the calibration-perplexity increase
    calibration_samples: int = 512  # input rows per linear kept for the AWQ error search
    calibration_max_tokens: int | None = None  # use only the first N calibration tokens (None: all)
    # A size target: each quantizable tensor gets the width (WIDTHS, or exact) that loses least, measured,
    # within bits per weight as mlx_lm counts them (every stored byte, scales included, over the parameter count).
    bpw: float | None = None
    sensitivity_from: str | None = None  # a store of the same source whose measured sensitivities plan this one
    rotate: str = "none"  # one of ROTATIONS: the source rotated first (calibration/rotate.py), the store plain layers
    # The written store's scales and offsets (widths below 8 bits) trained end to end against the float model's
    # logits on the calibration text, codes frozen (calibration/distill.py): Adam steps, one sample each, and its rate
    distill_steps: int = 0
    distill_rate: float = 6e-5

    def __post_init__(self) -> None:
        self.passthrough = tuple(self.passthrough)
        if self.scheme is None:
            self.scheme = "int8" if self.bpw is None else "int4"
        self.bits = tuple(tuple(rule) if isinstance(rule, list) else rule for rule in self.bits)  # JSON's lists
        if self.quantize_embeddings is None:
            self.quantize_embeddings = self.scheme in EMBEDDINGS_QUANTIZED_BY_DEFAULT
        if self.gptq is None and self.refit_scales is True:  # it refits GPTQ's grid
            self.gptq = True
        for method in ("awq", "gptq", "clip_search"):
            if getattr(self, method) is None:
                setattr(self, method, self.scheme in CALIBRATED_BY_DEFAULT)
        if self.gptq_embedding is None:
            self.gptq_embedding = bool(self.gptq)
        if self.gptq_tied_lookup is None:
            self.gptq_tied_lookup = bool(self.gptq)

    @property
    def calibrates(self) -> bool:
        """Whether compress runs the source model in float32: calibration (AWQ, GPTQ, mixed precision) or the INT3
        accuracy gate."""
        return bool(self.awq or self.gptq or self.mixed_precision > 0 or self.bpw is not None
                    or (self.scheme == "int3" and self.int3_gate))

    @property
    def stored_scheme(self) -> str:
        """The scheme linear weights are stored with: INT8 is group-wise ("int8g") unless asked per row."""
        if self.scheme == "int8":
            return "int8" if self.group_size == ROW else "int8g"
        return self.scheme

    @property
    def groups(self) -> int:
        """The group size of the stored scheme; 0 for the per-row form."""
        return 0 if self.group_size == ROW else self.group_size

    def validate(self) -> None:
        """Raise ValueError naming the option (as `name=value`) whose value compress cannot use."""
        if self.scheme not in SCHEMES_OFFERED:
            raise ValueError(f"scheme={self.scheme!r} is not a scheme compress offers; choose one of {', '.join(SCHEMES_OFFERED)}")
        if self.group_size not in GROUP_SIZES[self.scheme]:
            raise ValueError(
                f"group_size={self.group_size} is not valid for {self.scheme}; "
                f"choose one of {', '.join(map(str, GROUP_SIZES[self.scheme]))}"
            )
        self._validate_bits()
        if self.dtype is not None and self.dtype not in NP_STORAGE:
            raise ValueError(f"dtype={self.dtype!r} is not a float dtype; choose one of {', '.join(NP_STORAGE)}")
        if not 0 <= self.mixed_precision <= 1:
            raise ValueError(f"mixed_precision={self.mixed_precision} is not a fraction in [0, 1]")
        if self.bpw is not None:
            self._validate_bpw()
        elif self.sensitivity_from is not None:
            raise ValueError("sensitivity_from= plans the widths of a bits-per-weight target; give bpw= too")
        if not isinstance(self.refit_scales, bool):
            raise ValueError(f"refit_scales={self.refit_scales!r} is not True or False")
        if self.refit_scales and not self.gptq:
            raise ValueError("refit_scales=True refits the grid of GPTQ's codes, and GPTQ is off")
        for lookup in ("gptq_embedding", "gptq_tied_lookup"):
            if not isinstance(getattr(self, lookup), bool):
                raise ValueError(f"{lookup}={getattr(self, lookup)!r} is not True or False")
            if getattr(self, lookup) and not self.gptq:
                raise ValueError(f"{lookup}=True is a GPTQ of the embedding, and GPTQ is off")
        if self.rotate not in ROTATIONS:
            raise ValueError(f"rotate={self.rotate!r} is not a rotation compress offers; choose one of "
                             f"{', '.join(ROTATIONS)}")
        if self.calibration_samples < 1:
            raise ValueError(f"calibration_samples={self.calibration_samples} must be at least 1")
        self._validate_distill()
        unknown = sorted(set(self.tiers or ()) - set(ALL_TIERS))
        if unknown:
            raise ValueError(f"tiers= names unknown tier(s) {', '.join(unknown)}; choose from {', '.join(ALL_TIERS)}")

    def _validate_distill(self) -> None:
        if type(self.distill_steps) is not int or self.distill_steps < 0:
            raise ValueError(f"distill_steps={self.distill_steps!r} is not a number of steps (an integer >= 0)")
        if not isinstance(self.distill_rate, (int, float)) or not self.distill_rate > 0:
            raise ValueError(f"distill_rate={self.distill_rate!r} is not a learning rate (a number > 0)")
        if self.distill_steps and self.scheme == "int8" and not self.bits:  # INT8 tensors are not trained
            raise ValueError(f"distill_steps={self.distill_steps} trains the scales and offsets of group-wise "
                             f"tensors below 8 bits, and a {self.stored_scheme} store (scheme='int8') holds none; "
                             "use scheme='int4' or 'int3', bits= rules, or bpw=")
        if self.distill_steps and (self.calibration_max_tokens or math.inf) < 2 * DISTILL_SAMPLE_TOKENS:
            raise ValueError(f"distill_steps={self.distill_steps} needs two samples of {DISTILL_SAMPLE_TOKENS} "
                             f"calibration tokens (one held out); calibration_max_tokens={self.calibration_max_tokens}"
                             " gives fewer")

    def _validate_bpw(self) -> None:
        if not BPW_RANGE[0] <= self.bpw <= BPW_RANGE[1]:
            raise ValueError(f"bpw={self.bpw} is out of range; choose a number of bits per weight in "
                             f"[{BPW_RANGE[0]}, {BPW_RANGE[1]}]")
        if self.scheme != "int4" or self.group_size == ROW:
            raise ValueError(f"bpw={self.bpw} chooses every tensor's width itself (group-wise, groups of "
                             f"group_size); leave scheme={self.scheme!r} and group_size={self.group_size!r} out")
        if self.mixed_precision > 0:
            raise ValueError(f"bpw={self.bpw} and mixed_precision={self.mixed_precision} both choose widths; "
                             "give one of them")

    def _validate_bits(self) -> None:
        """Each `bits` rule: a pattern, a width of WIDTHS and, when given, a group size its scheme takes (else the
        store's must be one). Messages name a rule as `bits=PATTERN=N[/G]`, the CLI's spelling."""
        for rule in self.bits:
            if not (isinstance(rule, tuple) and len(rule) in (2, 3) and isinstance(rule[0], str)
                    and all(type(v) is int for v in rule[1:])):
                raise ValueError(f"bits= holds {rule!r}, not a (pattern, bits) pair or (pattern, bits, group size)")
            if rule[1] not in WIDTHS:
                raise ValueError(f"bits={rule_text(rule)} is not a width; choose bits from "
                                 f"{', '.join(map(str, WIDTHS))}")
            allowed = SCHEMES[WIDTHS[rule[1]]].group_sizes
            if len(rule) == 3 and rule[2] not in allowed:
                raise ValueError(f"bits={rule_text(rule)}: group size {rule[2]} is not one of "
                                 f"{', '.join(map(str, allowed))}")
            if len(rule) == 2 and self.group_size not in allowed:
                raise ValueError(f"bits={rule_text(rule)} needs group_size={self.group_size} to be one of "
                                 f"{', '.join(map(str, allowed))}")

    def width(self, name: str) -> tuple | None:
        """The first `bits` rule whose pattern matches canonical tensor `name`, or None."""
        return next((rule for rule in self.bits if fnmatch.fnmatchcase(name, rule[0])), None)

    def group_for(self, name: str) -> int:
        """The group size canonical tensor `name` is stored with when group-wise: its `bits` rule's, else the
        store's (0: per row)."""
        rule = self.width(name)
        return rule[2] if rule is not None and len(rule) == 3 else self.groups

    def check_tiers_fit_scheme(self) -> None:
        """Refuse a quantized tier that this store can never feed. A quantized tier holds the store's group-wise
        tensors when it holds any of the tier's width (docs/format.md §6.3): a store of that scheme, one whose `bits`
        rules name that width, or a bits-per-weight target's, whose plan may give any width. The API takes such a
        policy (the tier is skipped, as `tiers=` every tier reads); the CLI, where it is a user's mistake, refuses
        it."""
        if self.bpw is not None:
            return
        # (a rule of no width is validate()'s to refuse)
        fed = {self.scheme, *(NATIVE_TIERS.get(WIDTHS.get(rule[1], "")) for rule in self.bits)}
        for tier in sorted(set(self.tiers or ()) & set(QUANTIZED_TIERS) - fed):
            raise ValueError(f"tier {tier} is built only from a store holding {tier} tensors and this one is "
                             f"scheme={self.scheme} with no bits= rule of that width; leave {tier} out of tiers=, "
                             f"compress with scheme={tier}, or give a bits= rule of its width")


def rule_text(rule: tuple) -> str:
    """A `bits` rule as the CLI spells it: PATTERN=N, or PATTERN=N/G with its group size."""
    return f"{rule[0]}={'/'.join(map(str, rule[1:]))}"


def default_tiers(opts: CompressOptions, schemes: set[str]) -> tuple[str, ...]:
    """The cache policy of a store holding `schemes` without `tiers=`: mlx and the native tier of each scheme it
    holds and, when it holds any group-wise tensor, of its scheme (a mixed store's tensors may all have other
    widths)."""
    if any(SCHEMES[s].grouped for s in schemes):
        schemes = {*schemes, opts.stored_scheme}
    return ("mlx", *[tier for scheme, tier in NATIVE_TIERS.items() if scheme in schemes])


def runtime_dtype(provider: WeightProvider) -> str:
    """The dtype the model runs in: the source's own float dtype, or bfloat16 when the source is quantized."""
    dtype = source_dtype(provider)
    return dtype if dtype in NP_STORAGE else "bfloat16"


def source_dtype(provider: WeightProvider) -> str:
    """The dtype (or quant type: "Q4_1", "affine4", ...) of the source's largest tensor."""
    return max(provider.reader.tensors().values(), key=lambda t: t.nbytes).dtype


def weight_kinds(provider: WeightProvider, model: nn.Module | None = None) -> dict[str, str]:
    """The provider's tensors that nn.quantize would quantize in its model, by canonical name -> "linear",
    "embedding" or "int8" (model.quantizable_weights). `model`: the provider's model if the caller has built it."""
    from .model import new_model, quantizable_weights  # imports mlx_lm

    kinds = quantizable_weights(model if model is not None else new_model(provider.dense_config(), provider.reader.path))
    return {name: kinds[provider.mlx_name(name)] for name in provider.names() if provider.mlx_name(name) in kinds}


def choose_scheme(name: str, shape: tuple[int, ...], opts: CompressOptions, kind: str | None) -> tuple[str, str]:
    """(scheme, reason) for one tensor, by rule; `kind` is its weight_kinds entry (None: the model does not
    quantize it). The reason is recorded in the manifest."""
    if any(fnmatch.fnmatchcase(name, p) for p in opts.passthrough):
        return "passthrough", "matches --passthrough"
    if kind is None:
        return "passthrough", "not a weight nn.quantize quantizes (norm, bias, convolution, ...)"
    if kind == "matrix":  # model.MATRIX
        return "passthrough", "embedding the tied head multiplies by as a matrix (the model's code), kept dense"
    if kind == "embedding" and not opts.quantize_embeddings:
        return "passthrough", "embedding / lm_head (kept exact by --no-quantize-embeddings)"
    if kind == "int8" and opts.scheme != "int8":
        return "int8", "the model's quant_predicate keeps it at 8 bits"
    cols, groups = shape[-1], opts.group_for(name)
    if groups and cols % groups:
        return "passthrough", f"{cols} columns do not split into groups of {groups}"
    if kind != "int8" and (rule := opts.width(name)) is not None:  # the model's 8-bit wish above a rule's width
        return WIDTHS[rule[1]], f"matches --bits {rule_text(rule)}"
    return opts.stored_scheme, "linear weight"
