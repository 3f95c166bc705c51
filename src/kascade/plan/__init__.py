"""Plans: which layers are anchors, which anchor head each reuse head follows, the budget, and the model shape a plan
was made for (:mod:`.kascade_plan`), its reuse rule (:mod:`.reuse_rule`); their strict JSON form (:mod:`.json_form`); the plans shipped with the package
and a model's default plan (:mod:`.shipped`)."""

from .kascade_plan import KascadePlan, ModelFingerprint
from .reuse_rule import Reuse
from .shipped import SHIPPED_VARIANTS, default_plan, resolve_plan, shipped_plan, shipped_plans

__all__ = ["KascadePlan", "ModelFingerprint", "Reuse", "SHIPPED_VARIANTS", "default_plan", "resolve_plan", "shipped_plan",
           "shipped_plans"]
