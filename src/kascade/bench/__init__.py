"""`kascade bench`: end-to-end time to first token and inter-token latency, dense vs Kascade, in one run.

For each model, batch size ``B`` and prompt length ``L`` (a *configuration*), on the same weights and the same
random prompt (token ids drawn from a seeded generator):

- **dense**: eager decoding: the model's own attention implementation (transformers' SDPA unless the model says
  otherwise); graph decoding: :class:`~kascade.integration.graphs.DenseRuntime` (PyTorch SDPA with cuDNN attention
  first in priority for the prefill, Kascade's dense split-K Triton kernel for decode steps);
- **kascade**: ``kascade.enable(model, plan, backend=...)``;
- **no-attn**: :class:`~kascade.integration.runtime.NoAttention` attached for the time of the measurement (every
  attention layer returns zeros of the right shape), so that ``1 - t_noattn / t_dense`` is the share of the dense
  time spent in attention (prefill and decode).

``decode="graph"`` (the default on CUDA): the prompt is prefilled into a ``StaticCache`` and every decode step is
one CUDA-graph replay (:class:`~kascade.integration.graphs.GraphDecoder`), how serving engines decode;
``decode="eager"``: a ``DynamicCache`` and one Python-driven forward per step (at batch 1 the host then sets the
pace). TTFT = the prompt through the model (``logits_to_keep=1``; eager mode: optionally in chunks of
``prefill_chunk`` tokens) plus the argmax, synchronised before and after, median of ``repeats`` after one warm-up
prefill (dense and Kascade; the no-attention mode reuses dense's warmed-up kernels).
ITL = mean time of ``decode_steps`` greedy steps after the last timed prefill and ``warmup_decode_steps`` untimed
ones (graph mode: the eager steps before the capture, then the capture itself).
Peak memory = ``torch.cuda.max_memory_allocated`` per mode (weights included), reset before each mode.

Through ``generate`` (``Settings.generate``, the CLI's ``--decode-modes eager,compiled``): dense and Kascade again,
as users run them: ``model.generate`` eagerly (its DynamicCache) and compiled (``cache_implementation="static"`` and
transformers' compile config: torch.compile, fullgraph, a CUDA graph per step on GPUs), from per-token stamps
(CUDA events, :class:`~.timing.StepClock`): TTFT from generate's start to its first token, ITL the mean step after
warm-up steps; every configuration compiles afresh. The report puts them in a table of their own, each row naming its
mode.

Before a configuration runs, its peak memory is bounded from above for each mode (weights, KV cache and its growth,
activations, dense's masks, Kascade's selections and scratch) and the configuration is skipped with the reason when
it cannot fit; so is one predicted to overrun the time budget. Out-of-memory errors are caught per configuration and
recorded. Results are rewritten after every configuration (``bench.json``, ``bench.md``, ``bench.png``), so a run
cut short keeps what it finished.

Modules: :mod:`.settings` (what every configuration is measured with), :mod:`.models` (the models and their plans),
:mod:`.timing` (prefill, decode, the three modes), :mod:`.memory` (memory and time predictions, skip reasons),
:mod:`.report` (table, chart, files), :mod:`.runner` (the run loop and the command).
"""

from .memory import available_bytes, estimate_bytes, predict_seconds
from .models import LLAMA8B, MODELS, TINY, load, plan_for, random_llama
from .report import environment, plot, table, write
from .runner import main_args, run
from .settings import Settings
from .timing import (StepClock, decode, measure_config, measure_generate, measure_mode, measure_mode_graph, prefill,
                     prompt)

__all__ = [
    "LLAMA8B", "MODELS", "TINY", "Settings", "StepClock", "available_bytes", "decode", "environment", "estimate_bytes",
    "load", "main_args", "measure_config", "measure_generate", "measure_mode", "measure_mode_graph", "plan_for", "plot",
    "predict_seconds", "prefill", "prompt", "random_llama", "run", "table", "write",
]
