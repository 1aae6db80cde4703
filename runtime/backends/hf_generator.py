"""CPU generator: a transformers causal LM and a small batched sampling loop with a KV cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from runtime.backends.base import Completion
from runtime.models import ModelSpec, build_hf_model


class HFGenerator:
    """Samples from an HF `Qwen3ForCausalLM`/`LlamaForCausalLM` built from a `ModelSpec`.

    All prompts x n samples run as one batch (prompts left-padded, positions counted from each
    prompt's first token). The loop is ours rather than `model.generate`: it returns each sampled
    token's log-prob under `softmax(logits / temperature)` directly, and for small models it
    avoids generate's per-step overhead. `policy_version` is set by whoever loads weights.

    With `lora` (a recipe's `model.lora`), a version may be the adapter alone, under PEFT's
    names (runtime.models.peft_format): the targeted projections become W0 + (alpha / rank) B A,
    from the base weights W0 kept aside, so PEFT is not needed here. A version of base weights
    loads as without LoRA and becomes the new W0.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        weights: Mapping[str, Tensor] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        lora: Any = None,
    ):
        self.spec = spec
        self.lora = lora
        self.device = torch.device(device)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_ids = torch.tensor(eos, dtype=torch.long, device=self.device)
        self.pad_token_id = pad_token_id
        self.model = build_hf_model(
            spec, dtype=dtype, device=self.device, pad_token_id=pad_token_id, eos_token_id=eos
        )
        self.model.requires_grad_(False)
        self.policy_version = 0
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self._base: dict[str, Tensor] = {}  # W0 of each targeted projection, under LoRA
        self._keep_base()
        if weights is not None:
            self.load_weights(weights)

    def load_weights(self, hf_state_dict: Mapping[str, Tensor]) -> None:
        """Copy HF-named weights into the model in place (no rebuild); all must be present.
        Under LoRA: either every base weight, or the adapter alone (PEFT names); a dict that
        mixes the two is a bug (KeyError)."""
        state = dict(hf_state_dict)
        if self.lora is not None:
            from runtime.models.peft_format import adapter_only

            if adapter_only(state):
                self._merge_adapter(state)
                return
        result = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.spec.tie_embeddings else set()
        missing = set(result.missing_keys) - tied
        if missing or result.unexpected_keys:
            raise KeyError(
                f"weights do not fit the generator: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(result.unexpected_keys)[:5]}"
            )
        self._keep_base()

    def _keep_base(self) -> None:
        """Copy aside the weights the adapter adds to: what every adapter version merges into."""
        if self.lora is None:
            return
        from runtime.models.peft_format import adapter_layout, base_weight_name

        params = dict(self.model.named_parameters())
        targeted = {base_weight_name(k) for k in adapter_layout(self.spec, self.lora)}
        self._base = {name: params[name].detach().clone() for name in sorted(targeted)}

    @torch.no_grad()
    def _merge_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        from runtime.models.peft_format import check_adapter, merged, pairs

        check_adapter(tensors, self.spec, self.lora)
        params = dict(self.model.named_parameters())
        scaling = self.lora.scaling
        for name, (a, b) in pairs(tensors).items():
            w0 = self._base[name]
            params[name].copy_(merged(w0, a.to(w0.device), b.to(w0.device), scaling))

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: bool = True,
    ) -> list[Completion]:
        """`n` completions per prompt, prompt-major (result[i * n + j] is sample j of prompt i).

        `temperature` 0 decodes greedily (then without log-probs: `logprobs` must be False)."""
        if temperature < 0 or (temperature == 0 and logprobs):
            raise ValueError(
                f"temperature must be > 0 to sample with log-probs (got {temperature})"
            )
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rng = self._rng if seed is None else torch.Generator(self.device).manual_seed(seed)
        rows = [list(p) for p in prompts for _ in range(n)]
        batch = len(rows)
        width = max(len(r) for r in rows)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            attention[i, width - len(r) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        out_ids = torch.full((batch, max_new_tokens), self.pad_token_id, device=self.device)
        out_lp = torch.zeros((batch, max_new_tokens), device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), max_new_tokens, device=self.device)
        cache = None
        step_ids, step_pos = ids, positions
        for step in range(max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float() / (temperature or 1.0), dim=-1)
            token = logp.argmax(dim=-1) if temperature == 0 else _sample(logp, top_p, rng)
            token_lp = logp.gather(-1, token[:, None]).squeeze(-1)
            token = torch.where(done, self.pad_token_id, token)
            out_ids[:, step] = token
            out_lp[:, step] = torch.where(done, 0.0, token_lp)
            ended = ~done & torch.isin(token, self.eos_ids)
            lengths = torch.where(ended, step + 1, lengths)
            done = done | ended
            if bool(done.all()):
                break
            step_ids = token[:, None]
            step_pos = step_pos[:, -1:] + 1
            # Finished rows keep stepping on pad tokens; their outputs are discarded.
            attention = torch.cat([attention, attention.new_ones(batch, 1)], dim=1)

        out_ids, out_lp, lengths = out_ids.tolist(), out_lp.tolist(), lengths.tolist()
        eos = set(self.eos_ids.tolist())
        completions = []
        for i, r in enumerate(rows):
            k = int(lengths[i])
            stopped = k > 0 and out_ids[i][k - 1] in eos
            completions.append(
                Completion(
                    prompt_ids=r,
                    response_ids=out_ids[i][:k],
                    response_logprobs=out_lp[i][:k],
                    policy_version=self.policy_version,
                    finish_reason="stop" if stopped else "length",
                    prompt_index=i // n,
                )
            )
        return completions


def _sample(logp: Tensor, top_p: float, rng: torch.Generator) -> Tensor:
    """Draw one token per row from `exp(logp)`, restricted to the top-p nucleus if top_p < 1."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)
