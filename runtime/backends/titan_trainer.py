"""CPU trainer and reference: TorchTitan model definitions, AdamW, teacher-forced log-probs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.backends import trainer_state
from runtime.backends.base import (
    LossFn,
    finite_grad_norm,
    loss_inputs,
    token_entropy,
    token_logprobs,
)
from runtime.backends.blocks import micro_batches, wrap_blocks
from runtime.models import ModelSpec, build_model, to_hf
from runtime.models.loading import WeightSource, as_source, load_into
from runtime.models.lora import adapter_off, adapter_state, peft_state
from runtime.models.titan import materialize, meta_model

# Stats that add up across micro-batches (the loss is normalised by the whole batch's size).
_SUMMED_STATS = ("loss", "pg_loss", "response_tokens")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, then a constant or linearly decaying learning rate, and
    gradient-norm clipping.

    Linear decay (to 0 at `total_steps`, TRL's default) matters once a policy is nearly
    deterministic: gradients shrink, so does Adam's second moment, and one rare sample with a
    large advantage then moves the weights far at a constant rate (seen on the tiny task: reward
    0.98 -> 0.80 in one step at step 55 of 60).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # or "linear"
    total_steps: int = 0

    @classmethod
    def from_grpo(cls, grpo: Any) -> OptimizerConfig:
        """From a recipe's `grpo` section (learning rate and its schedule, weight decay,
        gradient clipping, warmup, steps)."""
        return cls(
            lr=grpo.learning_rate,
            weight_decay=grpo.weight_decay,
            max_grad_norm=grpo.max_grad_norm,
            warmup_steps=grpo.warmup_steps,
            schedule=getattr(grpo, "lr_schedule", "constant"),
            total_steps=grpo.steps,
        )

    def build(
        self, model: torch.nn.Module, *, fused: bool = False
    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over `model` (norm gains and 1-D tensors not decayed) and its LR schedule."""
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            if not param.requires_grad:  # a LoRA run's frozen base
                continue
            (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            fused=fused or None,  # None: torch picks the CPU default
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at optimizer step `step` (0-based), for LambdaLR."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "linear" and self.total_steps > self.warmup_steps:
            span = self.total_steps - self.warmup_steps
            return max(0.0, 1.0 - (step - self.warmup_steps) / span)
        return 1.0


def _load_or_init(
    spec: ModelSpec,
    weights: WeightSource | Mapping[str, Tensor] | None,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    lora: Any = None,
    attention: str = "sdpa",
) -> torch.nn.Module:
    """The seeded model, or one loaded from `weights`: one process holds all of it (the CPU
    path), so a source is read whole. With `lora`, the LoRA model of that base, its adapter
    seeded (runtime.models.loading.AdapterInit)."""
    if lora is not None:
        model = materialize(meta_model(spec, attention, lora=lora), device)
        load_into(model, as_source(weights, spec, seed, lora), "the trainer")
        if dtype != torch.float32:
            for param in model.parameters():
                param.data = param.data.to(dtype)
        return model
    model = build_model(spec, device=device, dtype=dtype, seed=seed, attention=attention)
    if isinstance(weights, WeightSource):
        weights = weights.state_dict()
    if weights is not None:
        model.load_state_dict(dict(weights), strict=True)
    return model


class TitanTrainer(trainer_state.Checkpointing):
    """The policy: a TorchTitan model with causal SDPA attention, trained by `train_step`.

    `weights` (TorchTitan names, e.g. from `load_pretrained`) replace the seeded random init.
    Log-probs use `softmax(logits / temperature)`, the generator's sampling distribution.
    With `lora` (a recipe's model.lora) only its adapter trains (see FSDPTrainer).
    """

    def __init__(
        self,
        spec: ModelSpec,
        optim: OptimizerConfig,
        *,
        temperature: float = 1.0,
        weights: WeightSource | Mapping[str, Tensor] | None = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tokens_per_micro_batch: int | None = None,
        activation_checkpointing: bool = False,
        lora: Any = None,
        attention: str = "sdpa",
    ):
        self.spec = spec
        self.attention = attention
        self.lora = lora
        self.optim_config = optim
        self.temperature = temperature
        self.device = torch.device(device)
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.activation_checkpointing = activation_checkpointing
        self.model = _load_or_init(spec, weights, seed, self.device, dtype, lora, attention)
        if activation_checkpointing:
            wrap_blocks(self.model, checkpointing=True, compile=False)
        self.model.train()
        self.optimizer, self.scheduler = optim.build(self.model)
        self.step = 0

    def _forward_logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        return self._forward(tokens, response_mask)[0]

    def _forward(self, tokens: Tensor, response_mask: Tensor, entropy: int = 0) -> Any:
        """(log-probs, entropy of the distribution that predicted each response token, or
        None); `entropy` 1 computes it without graph, 2 with."""
        tokens, mask = tokens.to(self.device), response_mask.to(self.device)
        logits = self.model(tokens)
        lp = token_logprobs(logits, tokens, mask, self.temperature)
        if not entropy:
            return lp, None
        with torch.set_grad_enabled(entropy == 2 and torch.is_grad_enabled()):
            source = logits if entropy == 2 else logits.detach()
            ent = torch.zeros(tokens.shape, device=lp.device)
            ent[:, 1:] = token_entropy(source[:, :-1], self.temperature)
            return lp, ent.masked_fill(~mask.bool(), 0.0)

    def logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """Teacher-forced log-probs `[B, T]` of the current policy (0 off the response)."""
        with torch.no_grad():
            return self._forward_logprobs(tokens, response_mask)

    def reference_logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """A LoRA run's reference: the base's log-probs `[B, T]`, the adapter off."""
        if self.lora is None:
            raise RuntimeError("reference_logprobs: a full-parameter trainer has no base to score")
        with torch.no_grad(), adapter_off(self.model):
            return self._forward_logprobs(tokens, response_mask)

    def train_step(
        self,
        tokens: Tensor,
        response_mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None,
        ref_logprobs: Tensor | None,
        loss_fn: LossFn,
        **loss_kwargs: Any,
    ) -> dict[str, float]:
        """One AdamW step on the whole batch (gradients accumulated over micro-batches of about
        `tokens_per_micro_batch` tokens)."""
        batch = tokens.shape[0]
        chunks = [slice(0, batch)]
        if self.tokens_per_micro_batch:
            chunks = micro_batches(tokens, self.tokens_per_micro_batch)
        loss_kwargs, loss_mask, entropy = loss_inputs(loss_kwargs, response_mask)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        weights: list[tuple[float, dict[str, float]]] = []
        for part in chunks:
            mask = response_mask[part].to(self.device)
            lp, ent = self._forward(tokens[part], mask, entropy)
            loss, stats = loss_fn(
                lp,
                None if old_logprobs is None else old_logprobs[part].to(self.device),
                None if ref_logprobs is None else ref_logprobs[part].to(self.device),
                advantages[part].to(self.device),
                mask,
                entropy=ent,
                loss_mask=None if loss_mask is None else loss_mask[part].to(self.device),
                **loss_kwargs,
            )
            loss.backward()
            weights.append((float(stats.get("response_tokens", mask.sum())), stats))
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainer_state.trained(self.model).values(), self.optim_config.max_grad_norm
        )
        norm = finite_grad_norm(grad_norm, self.step + 1)
        lr = self.optimizer.param_groups[0]["lr"]
        staging = self.checkpoint_staged()  # a checkpoint's copy of the state, if one is going
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

        token_total = sum(w for w, _ in weights) or 1.0
        for w, stats in weights:
            for key, value in stats.items():
                share = value if key in _SUMMED_STATS else value * w / token_total
                totals[key] = totals.get(key, 0.0) + share
        totals.update(grad_norm=norm, lr=lr, step=float(self.step))
        return totals | staging

    def sft_step(self, packs: Sequence[Any]) -> dict[str, float]:
        """One AdamW step of SFT on packed micro-batches (runtime.sft.data.Packed): the summed
        cross-entropy of the trained tokens over the step's count of them (each token weighs
        the same, whichever micro-batch it is in)."""
        from runtime.sft.train import packed_loss

        total = sum(p.trained_tokens for p in packs) or 1
        self.optimizer.zero_grad(set_to_none=True)
        summed = 0.0
        for p in packs:
            loss = packed_loss(self.model, p, self.attention, self.device)
            (loss / total).backward()
            summed += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainer_state.trained(self.model).values(), self.optim_config.max_grad_norm
        )
        norm = finite_grad_norm(grad_norm, self.step + 1)
        lr = self.optimizer.param_groups[0]["lr"]
        staging = self.checkpoint_staged()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {"loss": summed / total, "grad_norm": norm, "lr": lr, "step": float(self.step)} | (
            staging
        )

    def sft_loss(self, packs: Sequence[Any]) -> tuple[float, int]:
        """The summed cross-entropy of the trained tokens of `packs` and their count (no step)."""
        from runtime.sft.train import packed_loss

        with torch.no_grad():
            summed = sum(
                float(packed_loss(self.model, p, self.attention, self.device)) for p in packs
            )
        return summed, sum(p.trained_tokens for p in packs)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The current weights under HF names (detached; copy before mutating); a LoRA run's
        adapter alone, under PEFT's names."""
        if self.lora is not None:
            adapter = {k: v.detach() for k, v in adapter_state(self.model).items()}
            return peft_state(adapter, self.spec.family, self.lora, self.spec)
        return to_hf(self.model.state_dict(), self.spec)

    def _model_state(self) -> dict[str, Tensor]:
        if self.lora is None:
            return self.model.state_dict()
        return {k: v.detach() for k, v in trainer_state.trained(self.model).items()}

    def state_dict(self) -> dict[str, Any]:
        """Model (a LoRA run: its adapter), optimizer, scheduler and step: everything a resume
        needs."""
        return {
            "model": self._model_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["model"].keys() != self._model_state().keys():
            raise KeyError("checkpoint does not fit the model: its weights are not the trainer's")
        self.model.load_state_dict(state["model"], strict=self.lora is None)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])


class TitanReference:
    """A frozen copy of the initial policy; only scores tokens."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        temperature: float = 1.0,
        weights: WeightSource | Mapping[str, Tensor] | None = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.spec = spec
        self.temperature = temperature
        self.device = torch.device(device)
        self.model = _load_or_init(spec, weights, seed, self.device, dtype)
        self.model.eval().requires_grad_(False)

    @torch.inference_mode()
    def logprobs(self, tokens: Tensor, response_mask: Tensor) -> Tensor:
        """Teacher-forced log-probs `[B, T]` of the reference (0 off the response)."""
        tokens = tokens.to(self.device)
        return token_logprobs(
            self.model(tokens), tokens, response_mask.to(self.device), self.temperature
        )
