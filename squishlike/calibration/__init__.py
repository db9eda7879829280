"""Calibration-driven quantization quality: activation statistics, AWQ-style scaling, mixed precision
chosen by measured sensitivity, and the INT3 accuracy gate.

Everything here runs the *source* model in float32 on the shipped calibration text (`data/calibration.txt`, never
the evaluation prose), one layer at a time (`BlockRunner`, docs/design.md §7.1): never the whole model in memory.
`Calibrator` turns what each layer's pass measures into the `Plan` that `compress` applies to that layer's
tensors before the next layer runs:

- Activation statistics (`record`): a layer's linear inputs are recorded through thin wrapper modules while it
  runs: the per-channel mean |x| over all calibration tokens, and up to `samples` evenly spaced input rows.

- AWQ-style scaling (`search_awq`): for each group of linears that read the same input, a per-input-channel scale
  `s_j = mean|x_j|^alpha` (normalised so that sqrt(max * min) = 1) multiplies the weights' columns and is folded,
  divided out, into whatever produces that input, so the float model computes exactly the same function:

      group   scaled columns               folded into (divided by s)
      attn    q, k, v                      attention_norm weight (RMSNorm)
      o       attention.output             v rows (and v bias); GQA: s is shared by the query heads of a kv head
      mlp     ffn.gate, ffn.up             ffn_norm weight (RMSNorm)
      down    ffn.down                     ffn.up rows (and up bias)

  `alpha` is searched per group (0, 0.1, ..., 1, then +-0.05 around the best; 0 is round-to-nearest) to minimise the
  output error ||X W^T - X W_hat^T||^2 on the sampled calibration inputs, W_hat being the weight as the store
  will hold it (same scheme, group size, scale dtype and clip search, dequantized in the runtime dtype) with the
  scale divided back out. The store keeps the plain INT8/INT4/INT3 schemes (scaled weights quantized as usual)
  and the folded norms as passthrough, so every tier, the 4-bit repack included, is unchanged. Architectures: the
  plain-RMSNorm decoder families (llama, mistral, qwen2, qwen3); others are compressed without scaling and the
  manifest says why.

- GPTQ (`gptq`): every linear and expert stack the model quantizes, on any architecture the block runner runs,
  grouped by the input they read (`linears.input_groups`, found from the model), and the output head, rounded
  column by column on its layer's recorded inputs; an expert stack expert by expert, each on the rows routed to
  it (docs/design.md §7.2 for where its factorisation runs, §7.5 for the groups and the experts).

- Mixed precision (`plan_mixed`): each quantized tensor's cost is the change of its layer's output on the
  calibration inputs, measured at the store's scheme and at the higher one in a first block-by-block pass; the
  tensors whose higher precision saves the most per extra byte are promoted, greedily, until the extra bytes reach
  `mixed_precision` x the bytes of the quantized tensors at the store's scheme: an INT4/INT3 store keeps them at
  INT8, an INT8 store keeps them exact (passthrough, in the runtime dtype). Each chosen entry says so in its
  manifest "reason".

- The INT3 gate (`int3_gate`): the written (not yet published) store's perplexity on the calibration text,
  measured one layer at a time from the store, against the source's from the calibration pass;
  `evaluation.passes_gate` decides with the bound `int3_max_ppl_increase` (default +8 %). The verdict goes into
  manifest["int3_gate"]; the int3 tier is built only when it passed.

All forward passes are float32; on Linux CPU preload OpenBLAS for speed (the CLI does, see
`openblas.reexec_with_openblas`).
"""

from .awq import Transform, add_scales, fold_groups, group_scales, search_awq
from .blocks import BlockRunner
from .gate import int3_gate, store_perplexity
from .mixed import plan_mixed, tensor_losses
from .decision import Plan
from .plan import Calibrator
from .quantizer import Quantizer
from .stats import Calibration, ScaleGroup, calibration_windows, record

__all__ = [
    "BlockRunner", "Calibration", "Calibrator", "Plan", "Quantizer", "ScaleGroup", "Transform", "add_scales",
    "calibration_windows", "fold_groups", "group_scales", "int3_gate", "plan_mixed", "record", "search_awq",
    "store_perplexity", "tensor_losses",
]
