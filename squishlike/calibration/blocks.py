"""The source model run one block at a time over the calibration text, in bounded memory.

A block is what mlx_lm's model class calls a layer (`model.layers[i]`). The model is built without its weights
(mlx_lm's modules start with random, unevaluated arrays: no memory); only the weights outside the blocks
(embeddings, final norm, head) are read up front, in their stored dtype, and the vocabulary-sized ones are
dropped again once the capture pass is done (read again only for logits). One pass of the model with every block
replaced by a catcher records what the model hands each block besides the hidden state (attention masks, a
block's own per-layer inputs, what an earlier block returned beside its hidden state), and the input of the first
block. From then on a block's weights are read from the
source as float32 when its turn comes (`load`), it runs on the calibration windows' hidden states (`run`), and its
weights are dropped again (`release`): at any time one block's weights and the windows' hidden states are held,
never the whole model, so peak memory does not grow with depth.

The math runs on MLX's default device: the GPU where there is one (Metal, CUDA), else the CPU.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.switch_layers import SwitchLinear

from ..errors import UnsupportedArchitectureError
from ..evaluation import Window, nll_sum
from ..model import embedding_weights

WeightSource = Callable[[Sequence[str]], Iterable[tuple[str, mx.array]]]  # mlx names -> (name, array), lazily


class _Captured(Exception):
    """Ends the capture pass once the last block was reached: the final norm and head are not needed."""


class _StandIn(nn.Module):
    """Takes a block's place in the model; what the model asks of the block itself (`layer.use_sliding`) is the
    block's."""

    def __init__(self, block: nn.Module):
        super().__init__()
        object.__setattr__(self, "_block", block)

    def __getattr__(self, key):
        try:
            return super().__getattr__(key)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), key)


@dataclass(frozen=True)
class _Handed:
    """Stands for what block `block` hands back beside the hidden state, at `index` of the rest of its output
    (rwkv7's first layer's values, which every later layer mixes in; gemma4's keys, which later layers share):
    a marker in the capture pass; the block's own output when a later block runs."""
    block: int
    index: int


Key = int | str  # where a block takes the hidden state: a position, or a keyword (gptj's `inputs`)


def _by_key(args: tuple, kwargs: dict) -> dict:
    """A call's arguments by position and by keyword."""
    return {**dict(enumerate(args)), **kwargs}


def _is_data(value) -> bool:
    """Arrays, numbers, None and containers of them: what a block can be handed again on a later run. An object
    (a cache the model fills, a list a layer appends to) is state one run would leave for the next."""
    if isinstance(value, (list, tuple)):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(_is_data(v) for v in value.values())
    return value is None or isinstance(value, (mx.array, bool, int, float, str, _Handed))


class _Capture:
    """The capture pass's catchers, one in every block's place: each records its call's arguments and hands on a
    new array of the hidden state's values (with `_Handed` markers for the rest of a block's output, whose shape
    the first block's own call shows, built and never computed). The next catcher must receive that very array:
    where it does (first, second as talkie's, or by keyword as gptj's) is the hidden state's `key`; a model that
    changes the hidden state between its layers cannot be run one block at a time, and `broken` says why."""

    def __init__(self, runner: "BlockRunner"):
        self.runner, self.n = runner, len(runner)
        self.key: Key | None = None
        self.handed: mx.array | None = None  # what the last catcher handed on
        self.rest: tuple | None = None  # the rest of a block's output, markers for arrays; None: the hidden state only
        self.broken: str | None = None
        self.first_key: Key | None = None  # where the first catcher took the hidden state from
        self.first: mx.array | None = None  # and what it took

    def call(self, i: int, block: nn.Module, args: tuple, kwargs: dict):
        values = _by_key(args, kwargs)
        if i == 0:  # which array is the hidden state, the second layer's call shows; the first one, for now
            key = next((k for k, v in values.items() if isinstance(v, mx.array)), None)
            if key is None:
                self._break("its layers are not handed the hidden state")
            self.first_key, self.first = key, values[key]
            if self.rest is None:
                self.rest = self._rest(block(*args, **kwargs))
        else:
            key = next((k for k, v in values.items() if v is self.handed), None)
            if key is None or self.key not in (None, key):
                self._break("its layers do not hand the hidden state straight on to the next layer")
            self.key = key
        self.runner.calls[i].append((args, kwargs))
        if i == self.n - 1:
            raise _Captured
        self.handed = mx.array(values[key])
        return self.handed if not self.rest else (self.handed, *(_Handed(i, k) if isinstance(v, _Handed) else v
                                                                  for k, v in enumerate(self.rest)))

    def _rest(self, output) -> tuple:
        """The rest of the first block's output: markers for arrays (each block's own), numbers and None as
        they are."""
        if not isinstance(output, tuple):
            return ()
        for v in output[1:]:
            if not _is_data(v):
                self._break(f"its layers hand on a {type(v).__name__}, state the next layer changes")
        return tuple(_Handed(0, k) if v is not None and not isinstance(v, (bool, int, float, str)) else v
                     for k, v in enumerate(output[1:]))

    def _break(self, why: str):
        self.broken = self.broken or why
        raise _Captured


class _Catcher(_StandIn):
    def __init__(self, block: nn.Module, capture: _Capture, i: int):
        super().__init__(block)
        self._capture, self._i = capture, i

    def __call__(self, *args, **kwargs):
        return self._capture.call(self._i, object.__getattribute__(self, "_block"), args, kwargs)


class _Replay(_StandIn):
    """Stands in for a block when the model's own tail (final norm, head, soft-capping) turns the last block's
    output into logits: the last block's stand-in returns that output, the others pass their input on (with the
    capture's markers for the rest of a block's output: the tails of the models that run block by block read only
    the hidden state)."""

    def __init__(self, block: nn.Module, key: Key, rest: tuple, output: mx.array | None):
        super().__init__(block)
        self._key, self._rest, self._output = key, rest, output

    def __call__(self, *args, **kwargs):
        x = self._output if self._output is not None else _by_key(args, kwargs)[self._key]
        return (x, *self._rest) if self._rest else x


@dataclass(frozen=True)
class _Slot:
    container: list  # the list the model iterates over
    index: int
    prefix: str  # the block's parameters' mlx names start with this ("model.layers.3.")


def block_slots(model: nn.Module) -> list[_Slot]:
    """Where each of `model.layers` sits in the module tree; a typed error when mlx_lm's model has no such list."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise UnsupportedArchitectureError(f"{type(model).__module__}: the model has no list of layers to run "
                                           "one at a time")
    wanted = {id(b): i for i, b in enumerate(blocks)}
    slots: dict[int, _Slot] = {}
    for path, module in model.named_modules():
        for key, value in module.items():
            if isinstance(value, list):
                for j, item in enumerate(value):
                    if id(item) in wanted and id(item) not in slots:
                        slots[id(item)] = _Slot(value, j, f"{path}.{key}.{j}." if path else f"{key}.{j}.")
    if len(slots) != len(wanted):
        raise UnsupportedArchitectureError(f"{type(model).__module__}: {len(wanted) - len(slots)} of its layers "
                                           "are not in a list the model calls")
    return [slots[id(b)] for b in blocks]


class _ExpertByExpert(SwitchLinear):
    """An expert stack computed one BLAS product per expert on the rows routed to it: the same function (to float32
    rounding) as `mx.gather_mm`, which mlx[cpu] runs 6.5x slower (SwitchGLU of 8 experts 352 wide, 1,024 tokens, 2
    a token: 1.24 s against 0.19 s). The routing is read on the host, so a block's windows no longer run entirely
    side by side; on a CPU that costs less than it gains."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # Unsorted, x is [..., 1 or k, rows, in] for indices [..., k]; sorted, [n, rows, in] for indices [n]
        weight, shape = self["weight"], mx.broadcast_shapes(x.shape[:-2], indices.shape)
        rows, width = x.shape[-2:]
        flat = mx.broadcast_to(x, (*shape, rows, width)).reshape(-1, rows, width)
        experts = np.array(mx.broadcast_to(indices, shape).reshape(-1))
        order = np.argsort(experts, kind="stable")
        bounds = np.searchsorted(experts[order], np.arange(weight.shape[0] + 1)).tolist()
        parts = [(flat[mx.array(order[a:b])].reshape(-1, width) @ weight[e].T).reshape(b - a, rows, -1)
                 for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
        y = mx.concatenate(parts)[mx.array(np.argsort(order))].reshape(*shape, rows, -1)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


class BlockRunner:
    """A model's blocks over the token windows `windows`, one block's weights in memory at a time.

    `weights(names)` reads the named mlx parameters (lazily is fine); `names` are every parameter the source
    holds, by mlx name. `hidden[w]` is window w's hidden state entering the next block to run."""

    def __init__(self, model: nn.Module, names: Sequence[str], weights: WeightSource, windows: Sequence[Window]):
        self.model, self.weights, self.windows = model, weights, list(windows)
        model.eval()
        if mx.default_device() == mx.cpu:
            for _, module in model.named_modules():
                if type(module) is SwitchLinear:
                    module.__class__ = _ExpertByExpert
        self.slots = block_slots(model)
        self.block_names: list[list[str]] = [[] for _ in self.slots]
        outside = []
        for name in names:
            block = next((i for i, s in enumerate(self.slots) if name.startswith(s.prefix)), None)
            (outside if block is None else self.block_names[block]).append(name)
        self.outside_names = outside
        # Outside the blocks: embeddings and head stay in their stored dtype (at 7B, 2.2 GB each in float32; the
        # hidden states they produce are made float32), and are needed for the capture pass and for logits only:
        # dropped in between.
        self.vocabulary = [n for n in outside if n in embedding_weights(model)]
        self._load_outside(outside)
        self.calls: list[list[tuple[tuple, dict]]] = [[] for _ in self.slots]  # each block's, window by window
        self._streams = [mx.new_stream(mx.default_device()) for _ in self.windows]  # see `forward`
        capture = _Capture(self)
        self.hidden = [self._capture(capture, w) for w in self.windows]
        self.rest = capture.rest or ()  # what the blocks hand back beside the hidden state: `_Handed` for arrays
        self._settle()
        self._made: dict[int, tuple] = {}  # id(hidden state out) -> (it, block, window, the rest of the output),
        # of the runs of the blocks in `_linked` whose hidden state out is still held somewhere
        self._carried: dict[int, dict[int, tuple]] = {}  # block -> window -> the rest of its output, see `_carry`
        self._drop(self.vocabulary)
        self._held: set[int] = set()  # blocks loaded and not released since

    def _load_outside(self, names: Sequence[str]) -> None:
        loaded = [(n, a if a.ndim > 1 else a.astype(mx.float32)) for n, a in self.weights(names)]
        self.model.load_weights(loaded, strict=False)
        mx.eval([a for _, a in loaded])  # not model.parameters(): the blocks' random arrays stay unevaluated
        self._vocabulary_loaded = True

    def _drop(self, names: Sequence[str]) -> None:
        """Unevaluated zeros in place of the mlx parameters `names`: they hold no memory."""
        params = dict(tree_flatten(self.model.parameters()))
        self.model.load_weights([(n, mx.zeros(params[n].shape, params[n].dtype)) for n in names], strict=False)
        self._vocabulary_loaded = False

    def __len__(self) -> int:
        return len(self.slots)

    def block(self, i: int) -> nn.Module:
        return self.slots[i].container[self.slots[i].index]

    def _swap(self, stand_ins: Sequence[nn.Module]) -> list[nn.Module]:
        old = [self.block(i) for i in range(len(self.slots))]
        for s, m in zip(self.slots, stand_ins):
            s.container[s.index] = m
        return old

    def _capture(self, capture: _Capture, window: Window) -> mx.array:
        blocks = self._swap([_Catcher(self.block(i), capture, i) for i in range(len(self))])
        try:
            self.model(_inputs(window))
        except _Captured:
            pass
        except Exception as e:  # noqa: BLE001 - mlx_lm's code around its layers wanted more than the hidden state
            capture.broken = capture.broken or f"its forward pass needs more from a layer than the hidden state ({e})"
        finally:
            self._swap(blocks)
        # where every block takes the hidden state (a one-layer model: its first array)
        self.key: Key = capture.first_key if capture.key is None else capture.key
        args, kwargs = self.calls[0][-1] if self.calls[0] else ((), {})
        hidden = _by_key(args, kwargs).get(self.key)
        if not self.calls[0] or any(len(c) != len(self.calls[0]) for c in self.calls):
            capture.broken = capture.broken or "its forward pass does not call every layer once"
        elif hidden is None or hidden is not capture.first:  # the first layer's was not what the second was handed
            capture.broken = capture.broken or "its layers do not hand the hidden state straight on to the next layer"
        if capture.broken is not None:
            raise UnsupportedArchitectureError(f"{type(self.model).__module__}: cannot run one layer at a time: "
                                               f"{capture.broken}")
        hidden = hidden.astype(mx.float32)
        mx.eval(hidden)
        return hidden

    def _settle(self) -> None:
        """After the capture pass: the recorded calls without the hidden state (each run is handed its own), only
        what a block can be handed again, and which blocks' output later blocks take (`_Handed`, see `_carry`)."""
        self._linked: set[int] = set()
        for i, calls in enumerate(self.calls):
            for w, (args, kwargs) in enumerate(calls):
                values = _by_key(args, kwargs)
                values[self.key] = None
                for k, v in values.items():
                    if not _is_data(v):
                        raise UnsupportedArchitectureError(
                            f"{type(self.model).__module__}: cannot run one layer at a time: layer {i} is handed a "
                            f"{type(v).__name__} ({k}), state it leaves for the model or another layer")
                    if isinstance(v, _Handed):
                        self._linked.add(v.block)
                calls[w] = tuple(values[k] for k in range(len(args))), {k: values[k] for k in kwargs}

    def load(self, i: int) -> nn.Module:
        """Block `i` with its source weights in float32, read from the source unless it is held already (loaded
        and not released since: whoever changes a held block's weights puts them back)."""
        block = self.block(i)
        if i not in self._held:
            self.model.load_weights([(n, a.astype(mx.float32)) for n, a in self.weights(self.block_names[i])],
                                    strict=False)
            mx.eval(block.parameters())
            self._held.add(i)
        return block

    def set_weights(self, i: int, arrays: Iterable[tuple[str, mx.array]]) -> None:
        """Replace some of block `i`'s weights (mlx names) with `arrays`, made float32."""
        self.model.load_weights([(n, a.astype(mx.float32)) for n, a in arrays], strict=False)

    def release(self, i: int) -> None:
        """Drop block `i`'s weights: unevaluated zeros in their place hold no memory."""
        block = self.block(i)
        block.update(tree_map(lambda a: mx.zeros(a.shape, a.dtype), block.parameters()))
        self._held.discard(i)

    def run(self, i: int, hidden: Sequence[mx.array] | None = None) -> list[mx.array]:
        """Block `i` (loaded) on each window's hidden state (`self.hidden` by default): the outputs, evaluated."""
        outputs = [self.forward(i, w, h) for w, h in enumerate(self.hidden if hidden is None else hidden)]
        self.evaluate(i, outputs)
        return outputs

    def forward(self, i: int, window: int, hidden: mx.array) -> mx.array:
        """Block `i` on one window's hidden state, with what the model hands it for that window: its output, not
        evaluated yet, computed on the window's own stream. Windows evaluated together (`evaluate`) run side by
        side: on a CPU a block's attention spends half its time in a softmax that takes one core, so one window
        after another left a core of two idle (SmolLM2's three windows: 467 -> 360 ms a block, the same values)."""
        self._carry(i, window, hidden)
        args, kwargs = self.calls[i][window]
        with self._errors(i), mx.stream(self._streams[window]):
            args = [self._argument(i, window, hidden, k, v) for k, v in enumerate(args)]
            kwargs = {k: self._argument(i, window, hidden, k, v) for k, v in kwargs.items()}
            output = self.block(i)(*args, **kwargs)
        if not isinstance(output, tuple):
            return output
        if i in self._linked:  # kept while the hidden state it returned is held, by weak reference
            key = id(output[0])
            self._made[key] = weakref.ref(output[0], lambda _: self._made.pop(key, None)), i, window, output[1:]
        return output[0]

    def _argument(self, i: int, window: int, hidden: mx.array, key: Key, value):
        if key == self.key:
            return hidden
        if not isinstance(value, _Handed):
            return value
        if (rest := self._carried.get(value.block, {}).get(window)) is None:
            raise ValueError(f"it takes what layer {value.block} hands on, and no run of layer {value.block} "
                             "made this input")
        return rest[value.index]

    def _carry(self, i: int, window: int, hidden: mx.array) -> None:
        """Where block `i`'s input `hidden` is what a run of block i - 1 returned, keep the rest of that run's output
        for the blocks that take it (rwkv7's first layer's values, every later layer's). Of the many runs of a
        block (AWQ's trials, mixed precision's rounded weights), the one whose output goes on is the float model's
        pass."""
        made = self._made.get(id(hidden))
        if made is not None and made[0]() is hidden and made[1] == i - 1:
            self._carried.setdefault(made[1], {})[window] = made[3]

    def evaluate(self, i: int, arrays: Sequence[mx.array]) -> None:
        """Evaluate what `forward` (and what the block's recorders, stats.record) made of block `i`."""
        with self._errors(i):
            mx.eval(*arrays)

    @contextmanager
    def _errors(self, i: int):
        try:
            yield
        except (ValueError, TypeError, AttributeError) as e:  # a layer that needs what another layer made
            raise UnsupportedArchitectureError(f"{type(self.model).__module__}: layer {i} cannot run alone: {e}") \
                from e

    def module(self, path: str) -> nn.Module:
        return module_at(self.model, path)

    def logits(self, final: mx.array, window: Window) -> mx.array:
        """The model's logits for `window` given the last block's output `final`: the model's own tail (final
        norm, head, soft-capping) runs on it."""
        if not self._vocabulary_loaded:
            self._load_outside(self.vocabulary)
        n = len(self.slots)
        blocks = self._swap([_Replay(self.block(i), self.key, self.rest, final if i == n - 1 else None)
                             for i in range(n)])
        try:
            return self.model(_inputs(window))[0].astype(mx.float32)
        finally:
            self._swap(blocks)


    def perplexity(self, final: Sequence[mx.array]) -> float:
        """Perplexity on the windows, given each window's last block output."""
        nll, count = 0.0, 0
        for h, window in zip(final, self.windows):
            logits = self.logits(h, window)[window.first_target - 1:]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll += nll_sum(logprobs, mx.array(window.tokens[window.first_target:], dtype=mx.int32)).item()
            count += window.n_scored
        self.release_vocabulary()
        return math.exp(nll / max(count, 1))

    def release_vocabulary(self) -> None:
        """Drop the vocabulary-sized weights `logits` read (they are read again when next needed)."""
        if self._vocabulary_loaded:
            self._drop(self.vocabulary)


def module_at(model: nn.Module, path: str) -> nn.Module:
    """The module at mlx path `path` ("model.layers.3.mlp.up_proj"), reached part by part, not by listing every
    module of the model (`named_modules`), which calibration's recorders did 3 times each, 400 times a pass."""
    node = model
    for part in path.split(".") if path else ():
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node


def _inputs(window: Window) -> mx.array:
    return mx.array(window.tokens[:-1], dtype=mx.int32)[None]
