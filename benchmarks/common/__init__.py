"""What the benchmark scripts share: logging and output folders (:mod:`.report`), GPU timing (:mod:`.timing`), the
kernel benchmarks' shapes and inputs (:mod:`.shapes`), the floor under a reuse layer (:mod:`.gather`), teacher-forced
comparisons of plans (:mod:`.fidelity`), the documentation's results tables (:mod:`.tables`) and the pieces of the
tensor-parallel benchmark (``tp_*``). Nothing here imports a script."""

from .report import RowLog, log, out_folder

__all__ = ["RowLog", "log", "out_folder"]
