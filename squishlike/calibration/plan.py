"""The plan `compress` applies as it writes the tensors, decided block by block as the source model runs over the
calibration text (`Calibrator`): nothing ever holds the whole model in float32."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..compress_options import CompressOptions, runtime_dtype
from ..config import load_config
from ..errors import BudgetError, FormatError, UnsupportedArchitectureError
from ..io.checksum import check_files
from ..npydir import MANIFEST, NpyDir, TensorEntry, source_fingerprint
from ..model import model_tokenizer, new_model, tie_absent_head
from ..provider import WeightProvider
from ..quant.schemes import SCHEMES, rows_cols
from .awq import AWQ_GRID, ScaleGroup, add_scales, fold_groups, group_scales, search_awq
from .blocks import BlockRunner
from .decision import LOOKUP_GROUP, TIED_GROUP, Plan
from .gptq import DAMPING, EXPERT_MIN_ROWS
from .linears import input_groups, vocabulary
from .lookup import (RESIDUAL_PATHS, LookupProbe, OutputProbe, as_rows, head_hessian, head_trace, lookup_hessian,
                     normalised, path_hessians, rounding_probe, with_identity)
from .mixed import block_losses, fitting, lookup_losses, plan_mixed, plan_widths, tensor_choices, tensor_losses
from .quantizer import Quantizer
from .rounding import REFIT_METHOD
from .source import PLAN_GROUP_SIZES, SourceWeights
from .stats import (Calibration, calibration_windows, log, positions, record, record_head, sample_positions,
                    thinned)


class Calibrator:
    """Calibration for one compress. `units()` lists the source's tensors in the order compress writes them
    (the tensors outside the blocks, each block's, then the output head); `prepare(k)` runs unit k's block over
    the calibration windows' hidden states and puts in `plan` what compress needs to write it: AWQ's scales for
    the block's groups, GPTQ's inputs for its linears. Once compress has written it (`done(k)`), the block's
    weights are dropped and its outputs are the next block's inputs. Mixed precision, which chooses among all
    tensors at once, measures every tensor's sensitivity in a first pass of the same kind, before anything is
    written. A model whose layers cannot run one at a time is compressed without calibration; the manifest
    says why.
    """

    def __init__(self, provider: WeightProvider, opts: CompressOptions, side_files: Path, origin: Path | None = None):
        self.provider, self.opts = provider, opts
        self.origin = Path(provider.reader.path) if origin is None else origin  # the source the user named: with
        # rotate, `provider` reads its rotated copy
        self.plan = Plan(runtime=opts.dtype or runtime_dtype(provider))
        self.model = new_model(provider.dense_config(), provider.reader.path)
        tokenizer = model_tokenizer(load_config(side_files), side_files, provider.reader.path)
        self.windows = calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens)
        self.picks = sample_positions(self.windows, opts.calibration_samples)
        # GPTQ's Hessians take every calibration position: from the AWQ search's evenly spaced rows (463 of
        # SmolLM2's 2,311 by default, fewer than a down projection's 1,536 columns) GPTQ fits the few rows and
        # loses more at 2 and 3 bits than it saves (docs/design.md §7.4)
        self.every = sample_positions(self.windows, positions(self.windows))
        self.source = SourceWeights(provider, self.model, opts, self.plan.runtime)
        self._awq_groups: dict[int, list[ScaleGroup]] = {}  # block -> its AWQ groups (`_block_groups`)
        self._verified_folds: dict = {}  # awq.fold_groups' verdicts, per block structure
        self.awq_no_fold: dict[str, str] = {}  # reader group -> why AWQ found no exact fold for it
        self.canonical = {provider.mlx_name(n): n for n in provider.names()}
        tie_absent_head(self.model, self.canonical)
        self.embedding, self.head = vocabulary(self.model, self.canonical)
        self.awq: dict[str, dict] = {}
        self.known_alphas: dict[str, dict] = {}  # group -> AWQ's report, from the store sensitivities come from
        self.gptq_tensors: set[str] = set()
        self.gptq_left_out: dict[str, str] = {}  # linear -> why GPTQ could not take it
        self.expert_stacks: set[str] = set()  # the expert stacks GPTQ'd expert by expert
        self.lookup: dict[str, Any] = {}  # the embedding's lookup readers, or why none (`_lookup`)
        self.readers: mx.array | None = None  # their Hessian (`_lookup`)
        self.stopped: str | None = None  # why calibration stopped, when it did
        self.runner: BlockRunner | None = None
        # A tied matrix's: what its lookup weighs against its head; an untied embedding's: what each of
        # RESIDUAL_PATHS' roundings costs (`_tail`)
        self.probe: OutputProbe | None = None
        self.plan.record["calibration"] = {
            "text": "calibration",
            "tokens": positions(self.windows),
            "samples": opts.calibration_samples,
            "max_tokens": opts.calibration_max_tokens,
            "method": "block by block: each layer's inputs are the float32 outputs of the layer before",
            "gptq_rows": "every calibration position",  # (a store without it GPTQ'd the AWQ search's rows)
        }
        if opts.refit_scales:
            self.plan.refit_scales = True
            self.plan.record["scale_refit"] = {"method": REFIT_METHOD, "tensors": {}}

    def _weights(self, names):
        for n in names:
            yield n, self.provider.get(self.canonical[n])

    def units(self) -> list[tuple[str, list[str]]]:
        """(what, canonical names) in the order compress writes them: the tensors outside the blocks, each block's,
        then the output head's (whose GPTQ inputs exist once the last block ran). `prepare(k)` readies the plan for
        unit k, `done(k)` lets its weights go."""
        try:
            self.runner = BlockRunner(self.model, list(self.canonical), self._weights, self.windows)
        except UnsupportedArchitectureError as e:
            self._stop(str(e))
            return [("model", self.provider.names())]
        head = set(self.head.members) if self.head is not None else set()
        outside = [self.canonical[m] for m in self.runner.outside_names]
        if self._choosing_path():  # the untied embedding's rounding is chosen once the last block ran
            head.add(self.embedding)
        return [("embeddings", [n for n in outside if n not in head]),
                *((f"layer {i}", [self.canonical[m] for m in block]) for i, block in enumerate(self.runner.block_names)),
                ("head", [n for n in outside if n in head])]

    def prepare(self, k: int) -> None:
        """Make the plan ready for unit `k` of `units()`: run its block (or, for the head, the final norm; for the
        first unit, mixed precision's first pass)."""
        if self.runner is None or self.stopped is not None:
            return
        if k == 0 and self.opts.sensitivity_from is not None:
            self._measured_elsewhere()
        elif k == 0 and (self.opts.mixed_precision > 0 or self.opts.bpw is not None):
            first = list(self.runner.hidden)
            self._mixed(self.runner)
            self.runner.hidden = first
        elif 0 < k <= len(self.runner):
            try:
                self._block(self.runner, k - 1)
            except UnsupportedArchitectureError as e:
                self._stop(str(e))
        elif k == len(self.runner) + 1:
            self._tail(self.runner)
        if k == 0 and self.opts.gptq_embedding and self.head is None \
                and (h := self._lookup(self.runner, keep=True)) is not None:  # no head: the identity, unmeasured
            self._compensate(self.embedding, LOOKUP_GROUP, as_rows(with_identity(h)), None)
        if k == 0 and self.stopped is None and (self._choosing_path() or self.opts.gptq_tied_lookup and self._tied()):
            entering = self.runner.hidden[0]
            looked_up = mx.array(self.windows[0].tokens[:entering.shape[-2]])
            rows = np.array(self.provider.get(self.embedding)[looked_up].astype(mx.float32))  # not the whole table
            h = self._lookup(self.runner, keep=True)
            if self._tied():
                self.probe = LookupProbe.start(entering, rows)
            elif h is not None:
                self.probe = rounding_probe(entering, rows, path_hessians(h, self._head_hessian),
                                            self._gptq_quantizer(self.embedding))

    def done(self, k: int) -> None:
        """Unit `k` is written: its block's weights and GPTQ inputs go."""
        if self.runner is not None and 0 < k <= len(self.runner):
            self.runner.release(k - 1)
        self.plan.inputs.clear()

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a resumed compress needs to go on after the units written so far: (JSON, arrays)."""
        arrays = {f"hidden.{w}": np.array(h) for w, h in enumerate(self.runner.hidden)} if self.runner else {}
        if self.probe is not None:
            arrays.update({f"probe.{k}": np.array(h) for k, h in enumerate(self.probe.hidden)})
        for kind, table in (("col", self.plan.transform.col), ("row", self.plan.transform.row)):
            arrays.update({f"{kind}.{name}": v for name, v in table.items()})
        arrays.update({f"offset.{name}": np.array(v) for name, v in self.plan.transform.offset.items()})
        return {"record": self.plan.record, "awq": self.awq, "gptq_tensors": sorted(self.gptq_tensors),
                "expert_stacks": sorted(self.expert_stacks), "gptq_left_out": self.gptq_left_out,
                "awq_no_fold": self.awq_no_fold, "lookup": self.lookup,
                "promote": self.plan.promote, "group_sizes": self.plan.group_sizes, "stopped": self.stopped,
                "reference_ppl": self.plan.reference_ppl,
                "probe_sigma": getattr(self.probe, "sigma", None)}, arrays

    def restore(self, state: dict[str, Any], arrays: dict[str, np.ndarray], where: Path) -> None:
        """Go on from `state` (what `state()` saved after the units a killed compress had written, in `where`).
        Everything is checked before any of it is taken: FormatError naming `where` when it is not what `state()`
        saves (a scheme no store has, hidden states of another shape), and the calibrator is then as it was."""
        promote, group_sizes = state.get("promote"), state.get("group_sizes", {})
        problem = None
        if not all(isinstance(state.get(k), dict) for k in ("record", "awq")) or not isinstance(promote, dict) \
                or not isinstance(group_sizes, dict) or not isinstance(state.get("gptq_tensors"), list) \
                or not isinstance(state.get("stopped"), (str, type(None))) \
                or not isinstance(state.get("reference_ppl"), (int, float, type(None))) \
                or not isinstance(state.get("probe_sigma"), (float, type(None))) \
                or not all(isinstance(state.get(k, {}), dict) for k in ("gptq_left_out", "awq_no_fold", "lookup")) \
                or not all(isinstance(n, str) for n in state.get("expert_stacks", [])):
            problem = "is not a saved calibration state"
        elif bad := [s for s in promote.values() if not isinstance(s, str) or s not in SCHEMES]:
            problem = f"plans scheme {bad[0]!r}, which no store has"
        elif any(not isinstance(g, int) or g not in PLAN_GROUP_SIZES for g in group_sizes.values()):
            problem = "plans a group size no store has"
        hidden = self.runner.hidden if self.runner is not None else []
        for key, value in arrays.items():
            kind, _, name = key.partition(".")
            if kind == "hidden":
                w = int(name) if name.isdigit() else -1
                if not 0 <= w < len(hidden) or value.shape != tuple(hidden[w].shape) or value.dtype != np.float32:
                    problem = problem or f"holds hidden states {key} {value.dtype}{list(value.shape)}, not this run's"
            elif kind == "probe":
                if not hidden or value.shape != tuple(hidden[0].shape) or value.dtype != np.float32 \
                        or (state.get("probe_sigma") is None) == self._tied():
                    problem = problem or f"holds a probe {value.dtype}{list(value.shape)}, not this run's"
            elif kind not in ("col", "row", "offset") or value.dtype.kind != "f" \
                    or value.ndim != (0 if kind == "offset" else 1):
                problem = problem or f"holds {key!r}, which calibration never saves"
        probes = sorted(k for k in arrays if k.startswith("probe."))
        if probes and probes != [f"probe.{k}" for k in range(1 if self._tied() else len(RESIDUAL_PATHS))]:
            problem = problem or f"holds probes {probes}, not this run's"
        if problem is not None:
            raise FormatError(where, problem)
        self.plan.record, self.awq, self.plan.promote = state["record"], state["awq"], promote
        self.plan.group_sizes = group_sizes  # a checkpoint from before group sizes were planned has none
        self.gptq_tensors, self.stopped = set(state["gptq_tensors"]), state["stopped"]
        self.expert_stacks, self.gptq_left_out = set(state.get("expert_stacks", ())), state.get("gptq_left_out", {})
        self.awq_no_fold, self.lookup = state.get("awq_no_fold", {}), state.get("lookup", {})
        self.plan.reference_ppl = state["reference_ppl"]
        probed: dict[int, mx.array] = {}
        for key, value in arrays.items():
            kind, _, name = key.partition(".")
            if kind == "hidden":
                self.runner.hidden[int(name)] = mx.array(value)
            elif kind == "probe":
                probed[int(name)] = mx.array(value)
            elif kind == "offset":
                self.plan.transform.offset[name] = float(value)
            else:
                getattr(self.plan.transform, kind)[name] = value
        if probed:
            hidden = [probed[k] for k in sorted(probed)]
            self.probe = LookupProbe(hidden, state["probe_sigma"]) if self._tied() else OutputProbe(hidden)

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.plan.record["calibration"]["stopped"] = why
        warnings.warn(f"calibration stopped: {why}; the rest is rounded to nearest")

    def _block_groups(self, runner: BlockRunner, i: int) -> list[ScaleGroup]:
        """Block `i`'s AWQ groups (loaded): found once, from the model (awq.fold_groups)."""
        if not self.opts.awq:
            return []
        if i not in self._awq_groups:
            readers, _ = input_groups(runner, i, self.canonical, lambda name: True)
            self._awq_groups[i], no_fold = fold_groups(runner, i, self.canonical, readers, self.provider.config,
                                                       self._verified_folds)
            self.awq_no_fold.update(no_fold)
        return self._awq_groups[i]

    def _block(self, runner: BlockRunner, i: int) -> None:
        """Run block `i`; put its AWQ scales and its linears' GPTQ inputs in the plan; its outputs become the next
        block's inputs."""
        runner.load(i)
        groups = self._block_groups(runner, i)
        compensated = self._input_groups(runner, i, groups) if self.opts.gptq else []
        recorded = [*groups, *(g for g in compensated if g not in groups)]
        calib, runner.hidden = record(runner, i, recorded, self.every if self.opts.gptq else self.picks)
        if not self.plan.record.get("awq_from_first_pass"):
            self._search_awq(groups, thinned(calib, self.windows, self.opts.calibration_samples)
                             if self.opts.gptq else calib)
        if self.opts.gptq:
            self._gptq_inputs(compensated, calib)
        if self.probe is not None:
            self.probe.step(runner, i)

    def _input_groups(self, runner: BlockRunner, i: int, awq: list[ScaleGroup]) -> list[ScaleGroup]:
        """The block's linears GPTQ rounds, by the input they read (linears.input_groups), on any architecture; a
        group an AWQ group records as well is that AWQ group, so its input is recorded once."""
        found, left_out = input_groups(runner, i, self.canonical, lambda n: self._gptq_quantizer(n) is not None)
        self.gptq_left_out.update(left_out)
        same = {(g.module, frozenset(g.members)): g for g in awq}
        return [same.get((g.module, frozenset(g.members)), g) for g in found]

    def _search_awq(self, groups: list[ScaleGroup], calib: Calibration) -> None:
        """The AWQ scales of a block's groups, into the plan's transform and the manifest's report. Alphas a store
        of the same source found (`sensitivity_from`, with the same options) are taken, not searched again: the
        search is deterministic, so the scales are the ones it would find."""
        if self.opts.awq and groups and self.known_alphas:
            for g in groups:
                if (found := self.known_alphas.get(g.name)) is not None:
                    if found["alpha"] != 0.0 and (scales := group_scales(g, calib.abs_mean[g.name],
                                                                         found["alpha"])) is not None:
                        add_scales(self.plan.transform, g, scales)
                    self.awq[g.name] = found
        elif self.opts.awq and groups:
            transform, report = search_awq(groups, calib, self.source.weight, self.source.quantizer_for)
            self.plan.transform.update(transform)
            self.awq.update(report)

    def _gptq_inputs(self, groups: list[ScaleGroup], calib: Calibration, group: str | None = None) -> None:
        for g in groups:
            if not np.isfinite(calib.samples[g.name]).all():  # the float source overflows here: no Hessian
                self.gptq_left_out.update({m: "its calibration inputs are not finite" for m in g.members})
                continue
            for m in g.members:
                self._compensate(m, group or g.name, calib.samples[g.name], calib.experts.get(g.name))
                if g.kind == "experts" and m in self.gptq_tensors:
                    self.expert_stacks.add(m)

    def _compensate(self, name: str, group: str, x: np.ndarray, experts: np.ndarray | None) -> None:
        """GPTQ `name` on the Hessian of rows `x` (read by the linears of `group`), when it keeps a group-wise width."""
        if (qz := self._gptq_quantizer(name)) is not None:
            self.plan.inputs[name] = group, x, experts
            self.plan.quantizers[name] = qz
            self.gptq_tensors.add(name)

    def _tied(self) -> bool:
        return self.head is not None and self.embedding in self.head.members

    def _choosing_path(self) -> bool:
        """Whether the untied embedding's GPTQ models the residual path as measured (lookup.py's RESIDUAL_PATHS):
        GPTQ'd along its width, beside an output head of its own."""
        return bool(self.opts.gptq and self.opts.gptq_embedding and self.embedding is not None
                    and self.head is not None and not self._tied())

    def _head_hessian(self) -> mx.array:
        return head_hessian(self.runner, self.provider.get(self.head.members[0]))

    def _lookup(self, runner: BlockRunner, keep: bool = False) -> mx.array | None:
        """The Hessian of what reads a looked-up row in the first layer (lookup.py), its readers to the manifest;
        None where GPTQ does not round the embedding (no group-wise width) or no linear reads it so. Block 0 is read
        for it and dropped again; with `keep`, left held for its own unit, which then runs it without reading it
        again. Found once and held to the tail (a resumed compress finds it again)."""
        if self.embedding is None or self._gptq_quantizer(self.embedding) is None:
            return None
        if self.readers is None:
            runner.load(0)
            self.readers, self.lookup = lookup_hessian(runner, self.canonical)
            if not keep:
                runner.release(0)
        return self.readers

    def _gptq_quantizer(self, name: str) -> Quantizer | None:
        """The quantizer GPTQ rounds `name` with: the store's, or the group-wise width planned for it."""
        qz = self.source.quantizer_for(name)
        planned = self.plan.promote.get(name)
        if qz is None or planned is None:
            return qz
        if not SCHEMES[planned].grouped:
            return None
        return Quantizer(planned, self.plan.group_size(name, qz.group_size), qz.scale_dtype, qz.clip_search)

    def _tail(self, runner: BlockRunner) -> None:
        """After the last block: the output head's GPTQ inputs (the final norm's outputs) and the source's
        perplexity on the calibration text (the INT3 gate's reference)."""
        if self._choosing_path() and self.probe is not None and (h := self._lookup(runner)) is not None:
            kls = dict(zip(RESIDUAL_PATHS, self.probe.kls(runner)))
            chosen = min(kls, key=kls.get)
            self.lookup["residual_path"] = {"chosen": chosen, "kl": {p: float(f"{v:.6g}") for p, v in kls.items()}}
            hessian = path_hessians(h, self._head_hessian, (chosen,))[chosen]  # the head read again only if it weighs
            self._compensate(self.embedding, LOOKUP_GROUP, as_rows(hessian), None)
        if self.head is not None and self.opts.gptq:
            try:
                calib, group = record_head(runner, self.head, self.every), None
                if self._tied() and self.probe is not None and (h := self._lookup(runner)) is not None:
                    # a tied matrix: both its uses weigh, each by what an error in its rows costs
                    head, lookup = head_trace(calib.samples["head"]), self.probe.fisher_trace(runner)
                    weight = lookup / max(head, 1e-30)
                    self.lookup["weight"] = {"head": round(head, 6), "lookup": round(lookup, 6),
                                             "lookup_to_head": round(weight, 6)}
                    calib.samples["head"] = np.concatenate([normalised(calib.samples["head"]),
                                                            np.float32(math.sqrt(weight))
                                                            * normalised(as_rows(with_identity(h)))])
                    group = TIED_GROUP
                self._gptq_inputs([self.head], calib, group)
            except UnsupportedArchitectureError as e:
                self.gptq_left_out[self.head.members[0]] = str(e)
        if self.opts.scheme == "int3" and self.opts.int3_gate:
            self.plan.reference_ppl = runner.perplexity(runner.hidden)
            self.plan.record["calibration"]["reference_ppl"] = round(self.plan.reference_ppl, 6)

    def _mixed(self, runner: BlockRunner) -> None:
        """A first pass over every block: AWQ's scales (kept for the second pass) and each quantized tensor's
        sensitivity at every width it may take (mixed.py); then the widths: mixed precision's promotions, or a
        bits-per-weight target's plan."""
        started = time.perf_counter()
        offered = self.source.widths if self.opts.bpw is not None else (self.source.base, self.source.high)
        losses: dict[str, tuple[float, ...]] = {}
        shapes: dict[str, tuple[int, int]] = {}
        quantizers: dict[str, list[Quantizer]] = {}  # each tensor's: those of `offered` its columns take
        for i in range(len(runner)):
            candidates = self._candidates(runner.block_names[i])
            runner.load(i)
            inputs = runner.hidden
            groups = self._block_groups(runner, i)
            calib, runner.hidden = record(runner, i, [*groups, *candidates.values()], self.picks)
            self._search_awq(groups, calib)
            for name, g in candidates.items():
                w = self.source.weight(name)
                shapes[name], quantizers[name] = w.shape, fitting(offered, w.shape[1])
                losses[name] = block_losses(runner, i, self.provider.mlx_name(name), name, w,
                                            calib.samples[g.name], inputs, runner.hidden, self.plan.transform,
                                            quantizers[name], quantizers[name].index(self.source.base))
            runner.release(i)
        self._measure_vocabulary(runner, offered, quantizers, losses, shapes)
        self.plan.record["awq_from_first_pass"] = bool(self.awq)
        if self.opts.bpw is not None:
            self._plan_widths(shapes, quantizers, losses)
        else:
            chosen, report = plan_mixed(losses, shapes, self.source.base, self.source.high, self.opts.mixed_precision)
            self.plan.promote = {n: self.source.high.scheme for n in chosen}
            self.plan.record["mixed_precision"] = report
            log(f"mixed precision: {len(chosen)} of {len(losses)} tensors kept as {self.source.high.scheme} "
                f"(+{report['extra_bytes'] / 1e6:.2f} MB)")
        log(f"sensitivities measured in {time.perf_counter() - started:.1f} s")

    def _measure_vocabulary(self, runner: BlockRunner, offered, quantizers: dict, losses: dict,
                            shapes: dict) -> None:
        """The sensitivities of the output head (on its logits) and of the token embedding (on the rows the
        calibration text looks up), with each of `offered` that fits it; a tied pair is one tensor, whose losses
        add."""
        measured: dict[str, list[tuple[float, ...]]] = {}
        for name in (self.head.members[0] if self.head is not None else None, self.embedding):
            if name is not None and self.provider.has(name) and self.source.quantizer_for(name) == self.source.base \
                    and len(self.source.shape(name)) == 2:
                shapes[name] = rows_cols(self.source.shape(name))
                quantizers[name] = fitting(offered, shapes[name][1])
        if self.head is not None and self.head.members[0] in quantizers:
            name = self.head.members[0]
            x = record_head(runner, self.head, self.picks).samples["head"]
            measured[name] = [tensor_losses(name, self.source.weight(name), x, self.plan.transform,
                                            quantizers[name])]
        name = self.embedding
        if name in quantizers:
            w = self.source.weight(name)
            counts = np.bincount([t for win in self.windows for t in win.tokens[:-1]], minlength=w.shape[0])
            measured.setdefault(name, []).append(lookup_losses(name, w, counts, self.plan.transform,
                                                               quantizers[name]))
        for name, parts in measured.items():
            losses[name] = tuple(map(sum, zip(*parts)))

    def _plan_widths(self, shapes: dict[str, tuple[int, int]], quantizers: dict[str, list[Quantizer]],
                     losses: dict[str, tuple[float, ...]]) -> None:
        """Every measured tensor's width and group size for the bits-per-weight target, into the plan and the
        manifest: `losses` has, for each tensor of `shapes`, its loss with each of its `quantizers`."""
        choices = tensor_choices(losses, shapes, quantizers)
        infos = self.provider.reader.tensors()
        # The source's parameters: a rotation's untied head is bytes the target pays for, not parameters
        params = (self.opts.extra_manifest.get("rotation", {}).get("parameters")
                  or sum(math.prod(self.source.shape(n)) for n in self.canonical.values()))
        fixed = sum(self.source.stored_bytes(n, infos[self.provider.source_name(n)].dtype)
                    for n in self.canonical.values() if n not in choices)
        smallest = fixed + sum(min(c.nbytes for c in cs) for cs in choices.values())
        if smallest * 8 > self.opts.bpw * params:
            raise BudgetError(f"{self.origin}: bpw={self.opts.bpw} is below the smallest store of this "
                              f"model, {smallest * 8 / params:.3f} bits per weight (each tensor at its smallest "
                              "choice); choose a larger bpw")
        report = plan_widths(choices, int(self.opts.bpw * params / 8) - fixed, params, fixed, losses)
        report["target_bpw"] = self.opts.bpw
        self.plan.promote = dict(report["schemes"])
        self.plan.group_sizes = dict(report["group_sizes"])
        self.plan.promoted_by = f"a target of {self.opts.bpw} bits per weight"
        self.plan.record["bpw"] = report
        log(f"bits per weight: {report['planned_bpw']} planned for a target of {self.opts.bpw} "
            f"({', '.join(f'{n} {s}' for s, n in sorted(report['counts'].items()))})")

    def _measured_elsewhere(self) -> None:
        """The widths planned from the sensitivities a store of the same source kept (`sensitivity_from`).
        FormatError naming the store's manifest when it was made from another source (by content: its
        fingerprint), keeps no sensitivities, or keeps a record that is not one."""
        store = NpyDir(self.opts.sensitivity_from)
        where = store.path / MANIFEST
        if store.manifest.source.fingerprint != source_fingerprint(self.origin):
            raise FormatError(where, "its sensitivities were measured on another source (or the source has changed "
                                     "since): compress without sensitivity_from")
        rotation = store.manifest.extra.get("rotation")
        if (rotation.get("method") if isinstance(rotation, dict) else "none") != self.opts.rotate:
            raise FormatError(where, f"its sensitivities were measured on the source rotated otherwise (not "
                                     f"rotate={self.opts.rotate!r}): compress without sensitivity_from")
        bpw = store.manifest.extra.get("bpw")
        kept = bpw.get("sensitivity") if isinstance(bpw, dict) else None
        if not isinstance(kept, dict) or not kept:
            raise FormatError(where, "keeps no sensitivities (it was not compressed with bpw)")
        shapes, losses, quantizers = {}, {}, {}
        try:
            for name, entry in kept.items():
                shapes[name] = rows_cols(self.source.shape(name))
                if self.source.quantizer_for(name) is None:
                    raise FormatError(where, f"its sensitivities were measured with other options ({name} is not "
                                             "quantized with these): compress without sensitivity_from")
                losses[name] = tuple(float(v) for v in entry["losses"])
                if not all(math.isfinite(v) for v in losses[name]):
                    raise ValueError(f"{name}'s losses are not all finite numbers")
                # A record written before group sizes were chosen measured every width at the store's
                groups = entry.get("group_sizes", [store.manifest.group_size] * len(entry["schemes"]))
                quantizers[name] = [self._kept_quantizer(s, g, shapes[name][1])
                                    for s, g in zip(entry["schemes"], groups)]
                if not len(losses[name]) == len(groups) == len(quantizers[name]):
                    raise TypeError(f"{name}'s schemes, group sizes and losses differ in number")
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise FormatError(where, f"bad sensitivity record ({type(e).__name__}: {e})") from None
        self._plan_widths(shapes, quantizers, losses)
        self.plan.record["bpw"]["measured_in"] = str(store.path)
        awq = store.manifest.extra.get("awq")
        if isinstance(awq, dict) and awq.get("applied") and isinstance(awq.get("groups"), dict):
            for group, found in awq["groups"].items():
                alpha = found.get("alpha") if isinstance(found, dict) else None
                if not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
                    raise FormatError(where, f"bad AWQ record of group {group}: {found!r}")
            self.known_alphas = awq["groups"]
        self.plan.earlier, self.plan.unchanged = store, self._unchanged(store)
        log(f"{len(self.plan.unchanged)} of {len(self.plan.promote)} tensors keep the width they have in {store.path}: "
            "their parts are copied")

    def _unchanged(self, store: NpyDir) -> dict[str, TensorEntry]:
        """The entries of the tensors `store` holds as this compress will write them. A tensor's stored form
        follows from the source (the same: its fingerprint was checked), its width, the options that round it, and
        its calibration inputs, which are the float source model's (each block runs on the float outputs of the
        one before, never on rounded ones) scaled by AWQ's alphas (taken from `store`). So where `store` was made
        with the same rounding and calibration options and holds a tensor at the width and group size planned here,
        its parts are the ones this compress would compute, GPTQ's included: they are copied, not computed again.
        The store's files are checked against their recorded hashes first."""
        m, calibration = store.manifest, self.plan.record["calibration"]
        if not (m.clip_search == self.opts.clip_search and m.runtime_dtype == self.plan.runtime
                and ("awq" in m.extra) == bool(self.opts.awq) and ("gptq" in m.extra) == bool(self.opts.gptq)
                and ("scale_refit" in m.extra) == self.opts.refit_scales
                and "distill" not in m.extra  # its grid trained on the whole model: not what is rounded here
                and (not self.opts.gptq or self._same_lookup(m.extra["gptq"].get("lookup", {})))
                and {k: m.extra.get("calibration", {}).get(k) for k in calibration} == calibration):
            return {}
        found = {name: m.tensors[name] for name, scheme in self.plan.promote.items()
                 if name in m.tensors and m.tensors[name].scheme == scheme and SCHEMES[scheme].grouped
                 and (m.tensors[name].group_size, m.tensors[name].scale_dtype)
                 == (self.plan.group_size(name, self.opts.groups), self.plan.runtime)}
        if found:
            check_files(store.path, {rel: record.to_json() for rel, record in m.part_files().items()})
        return found

    def _same_lookup(self, earlier: dict) -> bool:
        """Whether a store's GPTQ lookup record says its embedding was rounded as this compress rounds it: the same
        options and, for a tied matrix, its lookup weighed by the probe's measurement (a store made while the option
        added the two Hessians at equal weights records no `weight`), for an untied one, its residual path chosen
        by the probe (one made before records no `residual_path`). Both follow from the source and the calibration
        text, which are checked."""
        return ({k: earlier.get(k) for k in ("embedding", "tied")}
                == {"embedding": self.opts.gptq_embedding, "tied": self.opts.gptq_tied_lookup}
                and ("weight" in earlier or not (earlier.get("tied") and self._tied()))
                and ("residual_path" in earlier or not (earlier.get("readers") and self._choosing_path())))

    def _kept_quantizer(self, scheme: str, group_size: int, cols: int) -> Quantizer:
        """The quantizer of a kept sensitivity record's choice (for a tensor of `cols` columns); TypeError when
        the record names a scheme or group size no store can hold."""
        kind = SCHEMES.get(scheme)
        if kind is None:
            raise TypeError(f"unknown scheme {scheme!r}")
        if kind.grouped and (group_size not in kind.group_sizes or cols % group_size):
            raise TypeError(f"{scheme} with group size {group_size!r} for {cols} columns")
        return Quantizer(scheme, group_size if kind.grouped else 0, self.plan.runtime, self.opts.clip_search)

    def _candidates(self, block_names: list[str]) -> dict[str, ScaleGroup]:
        """The block's 2-D weights the store quantizes with its scheme, as one-linear groups recording inputs."""
        found = {}
        for mlx in block_names:
            name = self.canonical[mlx]
            if mlx.endswith(".weight") and self.source.quantizer_for(name) == self.source.base \
                    and len(self.source.shape(name)) == 2:
                found[name] = ScaleGroup(name, "tensor", -1, mlx.removesuffix(".weight"), (name,), ())
        return found

    def manifest(self) -> dict[str, Any]:
        """The manifest keys calibration adds: what it measured and applied."""
        record = {k: v for k, v in self.plan.record.items() if k != "awq_from_first_pass"}
        if self.opts.awq:
            record["awq"] = self._awq_record()
        if self.opts.gptq:
            record["gptq"] = {
                "applied": bool(self.gptq_tensors),
                "method": f"GPTQ: columns rounded in order, each error spread by the inverse Hessian of the "
                f"layer's calibration inputs (damping {DAMPING} of its mean diagonal); grids are the store's own; "
                "every linear and expert stack the model quantizes, grouped by the input they read",
                "tensors": len(self.gptq_tensors),
                "samples": int(sum(len(p) for p in self.every)),
                "left_out": dict(sorted(self.gptq_left_out.items())),
                "lookup": {"embedding": self.opts.gptq_embedding, "tied": self.opts.gptq_tied_lookup,
                           **self.lookup},
            }
            if self.expert_stacks:
                record["gptq"]["experts"] = {
                    "per_expert": True,
                    "method": "each expert's Hessian from the calibration rows routed to it; an expert fewer than "
                    f"{EXPERT_MIN_ROWS} rows reached is pooled with its stack's mean row Hessian up to that many",
                    "stacks": sorted(self.expert_stacks),
                }
        return record

    def _awq_record(self) -> dict[str, Any]:
        mean_alpha = float(np.mean([r["alpha"] for r in self.awq.values()])) if self.awq else 0.0
        log(f"AWQ: {len(self.awq)} groups, mean alpha {mean_alpha:.2f}")
        return {
            "applied": bool(self.awq),
            "method": "per-input-channel s = mean|x|^alpha, alpha grid-searched per group on calibration "
            "output error; 1/s folded where the model computes exactly the same function (found by trying it): "
            "into the norm that produces the group's input, or the rows of the linear that does (v for o, up for "
            "down)",
            "grid": [*AWQ_GRID, "then best +- 0.05"],
            "groups": self.awq,
            "no_fold": dict(sorted(self.awq_no_fold.items())),
        }
