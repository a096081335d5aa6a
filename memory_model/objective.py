"""What a step optimizes (`ObjectiveConfig`): the supervised token mean, or DPO over preference pairs with TRL's
DPOConfig names and checks; and what the objective adds to the head's saved bytes (torch-free).

A DPO micro-batch holds its pairs' chosen rows, then their rejected rows: a batch of B pairs is a step of 2B
rows, priced as any step of 2B rows, plus the one fp32 number per row the loss keeps for its backward
(layers/preference.py); with LoRA, plus the reference's forward in the same step (`reference_in_step`)."""
from __future__ import annotations

from dataclasses import dataclass

from memory_model.settings import Choice, Number, SettingError, check_settings, setting

METHODS = ("sft", "dpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")  # TRL's names; `robust` alone reads label_smoothing


@dataclass(frozen=True)
class ObjectiveConfig:
    """The training method and DPO's settings (TRL's DPOConfig fields of the same names)."""

    method: str = setting("sft", "what a step optimizes: sft (the token mean of the learned tokens) or dpo "
                                 "(Direct Preference Optimization on prompt/chosen/rejected pairs, as TRL's "
                                 "DPOTrainer; --data of preference pairs)", Choice(METHODS),
                           "METHOD")
    beta: float = setting(0.1, "DPO: how far the policy may move from the reference (TRL's beta)",
                          Number(0.0, low_open=True), "BETA")
    loss_type: str = setting("sigmoid", "DPO: the loss of each pair (TRL's loss_type)", Choice(LOSS_TYPES), "TYPE")
    label_smoothing: float = setting(0.0, "DPO: the probability a preference is flipped, read by the robust loss "
                                          "(TRL's label_smoothing)", Number(0.0, 0.5, high_open=True), "P")

    def __post_init__(self) -> None:
        check_settings(self, SettingError)
        if self.label_smoothing and self.loss_type != "robust":
            raise SettingError("label_smoothing", f"is read by --loss-type robust only (it is {self.loss_type})")

    @property
    def preference(self) -> bool:
        """Rows come in pairs, chosen then rejected (DPO)."""
        return self.method == "dpo"

    def reference_in_step(self, lora: bool) -> bool:
        """DPO with LoRA computes its reference, the base with the adapters off, in the step's own forward: each
        unit loaded once runs for both, and the reference's hidden state is held from the first block's forward
        to the head's. Full fine-tuning's reference is computed before training (precompute_ref_log_probs)."""
        return self.preference and lora

    def saved_bytes(self, rows: int) -> int:
        """What the loss keeps for its backward beyond the token mean's: DPO's d loss / d each row's log-probability
        (fp32)."""
        return 4 * rows if self.preference else 0
