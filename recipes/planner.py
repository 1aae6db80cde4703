"""From a recipe and a GPU count to a plan: which service runs where, on how many GPUs.

The launcher (laptop) and the runtime (head node) both call `plan()` with the same recipe and GPU
count, so they agree on the layout without passing it around.

The search: every layout layout.share allows (recipes/layouts.py) is planned and its step
predicted (recipes/costs.py); the fastest that fits is the plan, the others its `candidates`
(`forgesky plan --explain`). The same search gives the least GPUs a recipe plans on
(`minimum_gpus`), the count a launch asks for (`launch_gpus`), and a run's hint where its own
prompt lengths would rank another layout first (`layout_hint`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recipes.costs import STALENESS_BOUND, ranking_words
from recipes.environment import check_env_plan
from recipes.errors import DoesNotFit, UserError
from recipes.gpu_plan import dedicated_gpus, predict_layout
from recipes.layouts import (
    colocated_plans,
    cpu_plan,
    dedicated_plan,
    trainer_reference_plans,
    widest,
)
from recipes.memory import disk_errors
from recipes.placements import shared_services
from recipes.plan_words import (
    Candidate,
    Plan,
    breakdown,
    fresher_policy_line,
    layout_hint_line,
    layout_words,
    shorter_prompts_line,
    staler_policy_line,
)
from recipes.schema import Recipe
from recipes.settings import check_push_buffer
from recipes.sft import sft_plan

# Plans stop here: 512 nodes of 8 GPUs (a count past this is a typo, not a cluster).
MAX_GPUS = 4096
MAX_GPUS_PER_NODE = 64


# Ties go to the layout with fewer services sharing (fewer turns, fewer fixed caches).
SHARE_ORDER = ("none", "trainer_reference", "all")


def minimum_gpus(recipe: Recipe, accelerator: str | None = None) -> int:
    """The least GPUs `plan()` accepts (0 on CPU): with layout.share none the services' sum;
    otherwise the smallest count on one node where some layout the share allows fits memory
    (the sum where none does)."""
    dedicated = dedicated_gpus(recipe)
    if recipe.cpu or recipe.kind == "sft" or recipe.layout.share == "none":
        return dedicated
    accelerator = accelerator or recipe.resources.accelerator
    top = recipe.resources.gpus_per_node
    if recipe.layout.share != "all":
        top = min(top, dedicated)
    for n in range(widest(recipe), top + 1):
        if any(c.refused is None for _, c in _candidates(recipe, n, n, accelerator)):
            return n
    return dedicated if recipe.layout.share == "auto" else widest(recipe)


# GPUs a node of the VM clouds comes with (1, 2, 4 or 8 of a kind); a Kubernetes cluster may
# grant any count.
SOLD_GPUS_PER_NODE = (1, 2, 4, 8)


def launch_gpus(recipe: Recipe) -> int:
    """The GPUs a launch asks for by default: the services' sum (layout.share all: the least
    that fits) rounded up to a count VM clouds sell (the planner gives the extra GPUs work),
    whole nodes past one node; 0 on CPU."""
    if recipe.cpu:
        return 0
    shared = recipe.kind == "grpo" and recipe.layout.share == "all"
    need = minimum_gpus(recipe) if shared else dedicated_gpus(recipe)
    gpn = recipe.resources.gpus_per_node
    if need > gpn:
        return -(-need // gpn) * gpn
    return next((n for n in SOLD_GPUS_PER_NODE if need <= n <= gpn), need)


def unsold_note(gpus: int, gpus_per_node: int) -> str | None:
    """A line for a GPU count per node that VM clouds do not sell, else None."""
    per_node = min(gpus, gpus_per_node)
    if per_node in SOLD_GPUS_PER_NODE:
        return None
    sold = ", ".join(map(str, SOLD_GPUS_PER_NODE[:-1])) + f" or {SOLD_GPUS_PER_NODE[-1]}"
    return (
        f"note: {per_node} GPUs a node: VM clouds sell {sold}, so only a Kubernetes cluster "
        "may grant this"
    )


def plan(
    recipe: Recipe,
    gpus: int,
    gpus_per_node: int | None = None,
    *,
    nodes: int | None = None,
    accelerator: str | None = None,
    other_types: bool = True,
) -> Plan:
    """Place every service of `recipe` on `gpus` GPUs (nodes of at most `gpus_per_node`), and
    plan the services' settings for them (recipes/settings.py).

    `gpus_per_node` defaults to the recipe's resources.gpus_per_node. A CPU recipe takes 0 GPUs
    and `nodes` machines (default 1). For a GPU recipe the node count follows from `gpus`;
    `nodes`, if given, must be that count. `accelerator` is the GPU type the settings are
    planned for: the recipe's resources.accelerator unless given (the runtime passes the one
    it found), one of it and its alternatives.

    layout.share picks which services may share GPUs; with auto every layout that fits is
    predicted (recipes/costs.py) and the fastest is taken, the others kept as `candidates`.

    Too few GPUs for the type: the refusal names the GPU types they fit on (`other_types`).
    """
    gpn = recipe.resources.gpus_per_node if gpus_per_node is None else gpus_per_node
    if nodes is not None and nodes < 1:
        raise UserError(f"a run needs at least 1 node, got {nodes}")
    if gpus < 0:
        raise UserError(f"--gpus {gpus}: a GPU count is 0 or more")
    if gpus > MAX_GPUS:
        raise UserError(f"--gpus {gpus}: a plan takes at most {MAX_GPUS} GPUs")
    if gpn > MAX_GPUS_PER_NODE:
        raise UserError(f"{gpn} GPUs per node: a node has at most {MAX_GPUS_PER_NODE}")
    if nodes is not None and nodes > MAX_GPUS:
        raise UserError(f"{nodes} nodes: a plan takes at most {MAX_GPUS}")
    # a disk set by hand must hold what the run writes (with a checkpoint bucket, the least)
    for line in disk_errors(recipe, bucket=True):
        raise UserError(line)
    if recipe.kind == "sft" and not recipe.cpu:
        accelerator = accelerator or recipe.resources.accelerator
        accepted = [recipe.resources.accelerator, *recipe.resources.alternatives]
        if accelerator not in accepted:
            raise UserError(
                f"{recipe.name} runs on {' or '.join(accepted)} (resources.accelerator and "
                f"resources.alternatives), not {accelerator}"
            )
        return sft_plan(recipe, gpus, gpn, nodes, accelerator)
    if recipe.cpu:
        if gpus != 0:
            raise UserError(
                f"{recipe.name} runs on CPU (resources.accelerator: cpu) and takes 0 GPUs, "
                f"got {gpus}; leave --gpus out (forgesky local {recipe.name} runs it here)"
            )
        if recipe.kind == "sft":
            return sft_plan(recipe, 0, 0, nodes, "cpu")
        cpu = cpu_plan(recipe, nodes or 1)
        check_env_plan(recipe, cpu.environment)
        if cpu.settings is not None:
            check_push_buffer(recipe, cpu.settings.weight_sync)
        return cpu
    accepted = [recipe.resources.accelerator, *recipe.resources.alternatives]
    accelerator = accelerator or recipe.resources.accelerator
    if accelerator not in accepted:
        raise UserError(
            f"{recipe.name} runs on {' or '.join(accepted)} (resources.accelerator and "
            f"resources.alternatives), not {accelerator}"
        )
    if gpn < 1:
        raise UserError(f"gpus_per_node must be at least 1, got {gpn}")
    share = recipe.layout.share
    dedicated = dedicated_gpus(recipe)
    if gpus < 1 or (share == "none" and gpus < dedicated):
        raise UserError(
            _too_few(recipe, gpus, accelerator) + _fits_on(recipe, gpus, accelerator, other_types)
        )
    num_nodes = -(-gpus // gpn)
    if num_nodes > 1 and gpus % gpn:
        options = [n for n in ((num_nodes - 1) * gpn, num_nodes * gpn) if n >= dedicated]
        raise UserError(
            f"{gpus} GPUs span {num_nodes} nodes, and a multi-node run uses whole nodes of "
            f"{gpn} GPUs: use {' or '.join(map(str, options))} GPUs"
        )
    if nodes is not None and nodes != num_nodes:
        raise UserError(
            f"{recipe.name} on {gpus} GPUs uses {num_nodes} node{'s' if num_nodes > 1 else ''} "
            f"of {min(gpus, gpn)} GPUs, not {nodes}: ask for {nodes * gpn} GPUs for {nodes} nodes"
        )
    per_node = gpus // num_nodes
    weighed = _candidates(recipe, gpus, per_node, accelerator)
    fits = [(p, c) for p, c in weighed if p is not None]
    if not fits:
        refusals = [c.refused for _, c in weighed if c.refused]
        if num_nodes == 1 and gpus < minimum_gpus(recipe, accelerator):
            # the memory arithmetic of a sharing layout refused at this count, if any
            why = next((c.refused for _, c in weighed if c.over_memory), None)
            why = why.removeprefix(f"{recipe.name}: ") if why else None
            raise UserError(
                _too_few(recipe, gpus, accelerator)
                + (f" ({why})" if why else "")
                + _fits_on(recipe, gpus, accelerator, other_types)
            )
        raise UserError(refusals[0] if refusals else _too_few(recipe, gpus, accelerator))
    best, _ = min(
        fits, key=lambda pc: (round(pc[1].step_s or 0.0, 3), SHARE_ORDER.index(pc[1].share))
    )
    candidates = tuple(dataclasses.replace(c, chosen=p is best) for p, c in weighed)
    _check_mps_shares(best)
    check_env_plan(recipe, best.environment)
    if best.settings is not None:
        check_push_buffer(recipe, best.settings.weight_sync)
    return dataclasses.replace(
        best,
        minimum_gpus=minimum_gpus(recipe, accelerator),
        # the recipe's own layout (a spread reference was planned on a copy with more GPUs)
        dedicated_gpus=dedicated,
        candidates=candidates if share == "auto" else (),
        shorter_prompts=_shorter_prompts(recipe, best, [p for p, _ in fits])
        if share == "auto"
        else "",
        staler_policy=_staler_policy(recipe, best),
        fresher_policy=_fresher_policy(recipe, best),
    )


def _staler_policy(recipe: Recipe, best: Plan) -> str:
    """Where the staleness bound (recipes.costs.staleness_chain) sets the chosen plan's step and
    one more version of grpo.max_policy_age would make it at least HINT_MARGIN shorter: the
    line that says so and how to set it."""
    here = best.predicted_step_s
    if best.settings is None or here is None or not best.prediction.startswith(STALENESS_BOUND):
        return ""
    g = recipe.grpo
    staler = recipe.model_copy(
        update={"grpo": g.model_copy(update={"max_policy_age": g.max_policy_age + 1})}
    )
    there = predict_layout(staler, best.accelerator, best.placements, best.settings).seconds
    if there > here * (1 - HINT_MARGIN):
        return ""
    return staler_policy_line(g.max_policy_age + 1, there, here)


def _fresher_policy(recipe: Recipe, best: Plan) -> str:
    """Where the recipe trains off-policy (grpo.max_policy_age above 0) and on-policy is
    predicted on the same layout within FRESHER_MARGIN of the chosen plan's step, the line
    that says so: there the staleness buys next to no speed (services that take turns on one
    GPU overlap nothing: on one H200, qwen3-1.7b on-policy took 5.00-5.67 s a step and one step
    off 5.79, bench/results/gpu_h200_2026-12-01-pairs), while each sample is trained on up to
    max_policy_age versions after the one that made it."""
    from recipes.loader import apply_overrides

    here, age = best.predicted_step_s, recipe.grpo.max_policy_age
    if best.settings is None or here is None or age == 0:
        return ""
    try:  # the line's --set as a user would give it (two steps a call need an older policy)
        on_policy = apply_overrides(recipe, ["grpo.max_policy_age=0"])
    except UserError:
        return ""
    there = predict_layout(on_policy, best.accelerator, best.placements, best.settings).seconds
    if there > here * (1 + FRESHER_MARGIN):
        return ""
    return fresher_policy_line(age, there, here)


def _shorter_prompts(recipe: Recipe, best: Plan, fits: list[Plan]) -> str:
    """Where layouts were ranked at the longest prompt (no dataset.prompt_tokens_mean) and
    shorter prompts would put another layout first by at least HINT_MARGIN: the line that
    says below which mean prompt length, and the setting that ranks at the user's own."""
    others = [p for p in fits if p.share != best.share and p.settings is not None]
    if recipe.dataset.prompt_tokens_mean is not None or not others or best.settings is None:
        return ""
    longest = recipe.grpo.max_prompt_tokens
    step = max(1, longest // 64)
    for prompt in range(longest - step, 0, -step):
        first = _another_first(recipe, best, others, prompt)
        if first is not None:
            here, seconds, share = first
            return shorter_prompts_line(prompt, share, seconds, here)
    return ""


def _another_first(
    recipe: Recipe,
    chosen: Plan,
    plans: list[Plan],
    prompt_tokens: float,
    response_tokens: float | None = None,
) -> tuple[float, float, str] | None:
    """At these mean lengths, where a plan of `plans` with another layout.share is predicted
    at least HINT_MARGIN faster than `chosen`: (chosen's seconds, the fastest such plan's,
    its layout.share); else None."""
    assert chosen.settings is not None

    def seconds(p: Plan) -> float:
        return predict_layout(
            recipe, chosen.accelerator, p.placements, p.settings, prompt_tokens, response_tokens
        ).seconds

    timed = [
        (seconds(p), p.share) for p in plans if p.share != chosen.share and p.settings is not None
    ]
    if not timed:
        return None
    here = seconds(chosen)
    fastest, share = min(timed)
    return (here, fastest, share) if fastest <= here * (1 - HINT_MARGIN) else None


# How much faster another layout must be predicted at a run's own lengths for the run to say so.
HINT_MARGIN = 0.10
# How little slower on-policy may be predicted for a plan to say that staleness buys no speed.
FRESHER_MARGIN = 0.02


def layout_hint(
    recipe: Recipe, chosen: Plan, prompt_tokens: float, response_tokens: float
) -> str | None:
    """Plans rank layouts (layout.share auto) at `recipes.costs.ranking_lengths`. At a run's
    own mean lengths another layout may be predicted faster: where one with another
    layout.share is by at least HINT_MARGIN, the line that says so, with the settings that
    take it; else None. (qwen3-1.7b on two H200s one step off-policy with 512-token
    completions: `all` 5.53 s against `trainer_reference` 6.21 s at 1024-token prompts, 3.50
    s against 2.93 s at 207; measured on one host at 207: 4.10 s and 3.16 s.)"""
    if chosen.cpu or recipe.layout.share != "auto" or chosen.settings is None:
        return None
    weighed = _candidates(recipe, chosen.total_gpus, chosen.gpus_per_node, chosen.accelerator)
    plans = [p for p, _ in weighed if p is not None]
    first = _another_first(recipe, chosen, plans, prompt_tokens, response_tokens)
    if first is None:
        return None
    here, seconds, share = first
    return layout_hint_line(
        chosen, prompt_tokens, response_tokens, share, seconds, here, ranking_words(recipe)
    )


def _check_mps_shares(chosen: Plan) -> None:
    """A share of the SMs is for a service that shares a GPU (an MPS client): one on GPUs of
    its own in the chosen layout would not use it."""
    shared = shared_services(chosen.placements)
    for name, _ in chosen.mps_sm_percent:
        if name not in shared:
            raise UserError(
                f"layout.mps_sm_percent.{name}: the {name} has GPUs of its own in this plan "
                f"(layout.share {chosen.share}); only services that share a GPU run under MPS"
            )


def _fits_on(recipe: Recipe, gpus: int, accelerator: str, look: bool) -> str:
    """Where `gpus` GPUs are too few on `accelerator`: the GPU types of recipes/gpus.py on
    which they plan (each planned as --gpu-type would), in words; "" where none or not `look`."""
    from recipes.gpus import GPU_TYPES

    if gpus < 1 or not look:
        return ""
    fits = []
    for other in GPU_TYPES:
        if other == accelerator:
            continue
        resources = recipe.resources.model_copy(update={"accelerator": other, "alternatives": []})
        try:
            plan(recipe.model_copy(update={"resources": resources}), gpus, other_types=False)
        except UserError:
            continue
        fits.append(other)
    if not fits:
        return ""
    return f"; {gpus} GPUs fit on {' or '.join(fits)} (--gpu-type {fits[0]})"


def _too_few(recipe: Recipe, gpus: int, accelerator: str) -> str:
    """The one line for a count below what fits: both minimums where sharing is allowed."""
    dedicated = dedicated_gpus(recipe)
    own = f"{dedicated} GPUs ({breakdown(recipe)})"
    share = recipe.layout.share
    if share == "none":
        auto = recipe.model_copy(update={"layout": _with_share(recipe, "auto")})
        shared = minimum_gpus(auto, accelerator)
        more = (
            f"; {shared} with services sharing GPUs (layout.share auto)"
            if shared < dedicated
            else ""
        )
        return f"{recipe.name} needs at least {own}{more}; got {gpus}"
    least = minimum_gpus(recipe, accelerator)
    if least >= dedicated:
        return f"{recipe.name} needs at least {own}, also with services sharing GPUs on an {accelerator}; got {gpus}"
    return (
        f"{recipe.name} needs at least {least} GPU{'s' if least != 1 else ''} on an "
        f"{accelerator} with services sharing "
        f"them (layout.share {share}), {own} with a GPU for each service; got {gpus}"
    )


def _with_share(recipe: Recipe, share: str) -> Any:
    return recipe.layout.model_copy(update={"share": share})


def _candidates(
    recipe: Recipe, gpus: int, per_node: int, accelerator: str
) -> list[tuple[Plan | None, Candidate]]:
    """Every layout layout.share allows on `gpus` GPUs: its plan with a predicted step, or None
    and why it does not fit."""
    share = recipe.layout.share
    kinds = SHARE_ORDER if share == "auto" else (share,)
    num_nodes = -(-gpus // per_node)
    out: list[tuple[Plan | None, Candidate]] = []
    for kind in kinds:
        if kind == "none" and gpus < dedicated_gpus(recipe):
            out.append((None, Candidate(kind, "-", refused=_too_few_own(recipe, gpus))))
            continue
        if kind == "trainer_reference" and not recipe.layout.reference.on_gpu:
            continue  # no reference on a GPU: the same as none
        if kind != "none" and num_nodes > 1:
            out.append(
                (
                    None,
                    Candidate(
                        kind,
                        "-",
                        refused=f"{recipe.name}: layout.share {kind} runs on one node; use at most {per_node} GPUs",
                    ),
                )
            )
            continue
        builders = {
            "none": lambda: [dedicated_plan(recipe, gpus, per_node, num_nodes, accelerator)],
            "trainer_reference": lambda: trainer_reference_plans(recipe, gpus, accelerator),
            "all": lambda: colocated_plans(recipe, gpus, accelerator),
        }
        try:
            plans = builders[kind]()
        except UserError as e:
            over = isinstance(e, DoesNotFit)
            out.append((None, Candidate(kind, "-", refused=str(e), over_memory=over)))
            continue
        for p in plans:
            out.append((p, _candidate(recipe, p)) if isinstance(p, Plan) else (None, p))
    return out


def _too_few_own(recipe: Recipe, gpus: int) -> str:
    return (
        f"{recipe.name} needs at least {dedicated_gpus(recipe)} GPUs with GPUs of their own "
        f"({breakdown(recipe)}); got {gpus}"
    )


def _candidate(recipe: Recipe, p: Plan) -> Candidate:
    g = recipe.grpo
    g_per_step = 0.0
    if p.predicted_step_s:
        g_per_step = g.prompts_per_step * g.group_size / (p.predicted_step_s * p.total_gpus)
    return Candidate(
        share=p.share,
        layout=layout_words(p.placements, p.num_nodes),
        step_s=p.predicted_step_s,
        samples_per_s_per_gpu=round(g_per_step, 2) if g_per_step else None,
        bound_by=p.prediction,
    )
