"""What a step optimizes (`ObjectiveConfig`): the supervised token mean, DPO over preference pairs with TRL's
DPOConfig names and checks, or GRPO with TRL's GRPOConfig names; and what the objective adds to the head's saved
bytes (torch-free).

A DPO micro-batch holds its pairs' chosen rows, then their rejected rows: a batch of B pairs is a step of 2B
rows, priced as any step of 2B rows, plus the one fp32 number per row the loss keeps for its backward
(layers/preference.py); with LoRA, plus the reference's forward in the same step (`reference_in_step`). A GRPO
step's rows are its completions (--batch counts them, as TRL's per-device batch),
each with its prompt; its loss keeps one fp32 number per position (layers/grpo.py).

`beta` and `loss_type` are both methods' (TRL's names): the fields' defaults are DPO's, and `with_method_defaults`
gives GRPO's (TRL's: beta 0, dapo) where settings change the method to grpo and do not name them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from memory_model.settings import Choice, Integer, Number, SettingError, Text, check_settings, setting

METHODS = ("sft", "dpo", "grpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")  # TRL's names; `robust` alone reads label_smoothing
GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # TRL's; layers.grpo.LOSS_TYPES computes them
_DPO_DEFAULTS = {"beta": 0.1, "loss_type": "sigmoid"}  # the fields' own
METHOD_DEFAULTS = {"sft": _DPO_DEFAULTS, "dpo": _DPO_DEFAULTS, "grpo": {"beta": 0.0, "loss_type": "dapo"}}


def with_method_defaults(flat: Mapping[str, Any], method: str) -> dict[str, Any]:
    """Settings by flat name over a config of `method`: where they change the method, the new method's defaults
    of what they do not name."""
    new = flat.get("method", method)
    return {**METHOD_DEFAULTS.get(new, {}), **flat} if new != method else dict(flat)


@dataclass(frozen=True)
class ObjectiveConfig:
    """The training method and DPO's settings (TRL's DPOConfig fields of the same names)."""

    method: str = setting("sft", "what a step optimizes: sft (the token mean of the learned tokens), dpo "
                                 "(Direct Preference Optimization on prompt/chosen/rejected pairs, as TRL's "
                                 "DPOTrainer; --data of preference pairs) or grpo (Group Relative Policy "
                                 "Optimization, as TRL's GRPOTrainer; --data of prompts, --reward-funcs)",
                          Choice(METHODS), "METHOD")
    beta: float = setting(0.1, "TRL's beta. DPO: how far the policy may move from the reference (default: 0.1); "
                               "GRPO: the weight of the KL to the reference (default: 0)", Number(0.0), "BETA")
    loss_type: str = setting("sigmoid", "TRL's loss_type. DPO: the loss of each pair (default: sigmoid); GRPO: how "
                                        "the tokens' losses are reduced (default: dapo)",
                             Choice(LOSS_TYPES + GRPO_LOSS_TYPES), "TYPE")
    label_smoothing: float = setting(0.0, "DPO: the probability a preference is flipped, read by the robust loss "
                                          "(TRL's label_smoothing)", Number(0.0, 0.5, high_open=True), "P")

    num_generations: int = setting(8, "GRPO: completions sampled per prompt, whose rewards are compared (TRL's "
                                      "num_generations; --batch counts completions and is a multiple of it)",
                                   Integer(2), "N")
    max_completion_length: int = setting(256, "GRPO: the most tokens a completion has (TRL's max_completion_length)",
                                         Integer(), "N")
    temperature: float = setting(1.0, "GRPO: the sampling temperature, at which the log-probabilities are taken too "
                                      "(TRL's temperature)", Number(0.0, low_open=True), "T")
    top_p: float = setting(1.0, "GRPO: nucleus sampling's probability mass (TRL's top_p)",
                           Number(0.0, 1.0, low_open=True), "P")
    epsilon: float = setting(0.2, "GRPO: the ratio's clipping range (TRL's epsilon)", Number(0.0), "EPS")
    num_iterations: int = setting(1, "GRPO: optimizer steps on each batch of completions (TRL's num_iterations)",
                                  Integer(), "N")
    reward_funcs: str | None = setting(None, "GRPO: the reward functions, module:function[,module:function...], each "
                                             "f(prompts, completions, **columns) -> one float per completion (TRL's "
                                             "reward_funcs; the module imported from the working directory too)",
                                       Text(), "MOD:FN")
    reward_weights: str | None = setting(None, "GRPO: one weight per reward function, comma-separated (TRL's "
                                               "reward_weights; default: 1 each)", Text(), "W1,W2")

    def __post_init__(self) -> None:
        check_settings(self, SettingError)
        if self.method == "dpo" and self.beta == 0:
            raise SettingError("beta", "must be a positive number for --method dpo, got 0")
        if self.loss_type not in (GRPO_LOSS_TYPES if self.method == "grpo" else LOSS_TYPES):
            owner, types = ("GRPO", GRPO_LOSS_TYPES) if self.method == "grpo" else ("DPO", LOSS_TYPES)
            raise SettingError("loss_type", f"{self.loss_type} is not one of {owner}'s: {', '.join(types)}")
        if self.method == "grpo":
            self.reward_weight_values()
        if self.label_smoothing and self.loss_type != "robust":
            raise SettingError("label_smoothing", f"is read by --loss-type robust only (it is {self.loss_type})")

    @property
    def preference(self) -> bool:
        """Rows come in pairs, chosen then rejected (DPO)."""
        return self.method == "dpo"

    @property
    def grpo(self) -> bool:
        """Rows are completions sampled in the loop, each with its prompt (GRPO)."""
        return self.method == "grpo"

    def reward_specs(self) -> list[str]:
        """--reward-funcs, one `module:function` each."""
        return [s.strip() for s in (self.reward_funcs or "").split(",") if s.strip()]

    def reward_weight_values(self) -> list[float] | None:
        """--reward-weights as numbers, one per reward function (None: 1 each)."""
        if self.reward_weights is None:
            return None
        try:
            weights = [float(w) for w in self.reward_weights.split(",")]
        except ValueError:
            raise SettingError("reward_weights", f"must be comma-separated numbers, got {self.reward_weights!r}") \
                from None
        if len(weights) != len(self.reward_specs()):
            raise SettingError("reward_weights", f"gives {len(weights)} weights for {len(self.reward_specs())} "
                                                 "--reward-funcs; give one per function")
        return weights

    def reference_in_step(self, lora: bool) -> bool:
        """DPO with LoRA computes its reference, the base with the adapters off, in the step's own forward: each
        unit loaded once runs for both, and the reference's hidden state is held from the first block's forward
        to the head's. Full fine-tuning's reference is computed before training (precompute_ref_log_probs)."""
        return self.preference and lora

    def saved_bytes(self, rows: int, seq: int) -> int:
        """What the loss keeps for its backward beyond the token mean's, for `rows` rows of `seq` tokens: DPO's
        d loss / d each row's log-probability, GRPO's d loss / d each position's (fp32)."""
        return 4 * rows if self.preference else 4 * rows * seq if self.grpo else 0
