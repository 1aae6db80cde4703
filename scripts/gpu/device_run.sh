#!/usr/bin/env bash
# On the GPU machine, in the checkout's root (where every device call starts):
#   scripts/gpu/device_run.sh stage    copy the wheel chunk(s) carried in this call to /tmp/asm
#   scripts/gpu/device_run.sh check    stage, install if needed, print versions and the GPU
#   scripts/gpu/device_run.sh tests    stage, install if needed, `pytest -m gpu` (the whole suite:
#                                      more than one call's 10 minutes)
#   scripts/gpu/device_run.sh tests GROUP  one group of the suite (scripts/gpu/suite.py; `groups`
#                                      lists them), its log $OUT/gpu_suite_GROUP.log
#   scripts/gpu/device_run.sh suite GROUP...  stage, install if needed, then the groups at once,
#                                      each on GPUs of its own (in waves where they do not all
#                                      fit), a log each; `suite --dry-run GROUP...` prints what
#                                      each would run, where, and nothing else
#   scripts/gpu/device_run.sh groups   the suite's groups: name, GPUs, estimated minutes, tests
#   scripts/gpu/device_run.sh faults   stage, install if needed, tests/test_gpu_faults.py (GPU faults)
#   scripts/gpu/device_run.sh trainer-tests  the trainer's GPU tests (.whl/tt is enough)
#   scripts/gpu/device_run.sh grpo     stage, install if needed, bench/gpu_grpo.py grpo
#   scripts/gpu/device_run.sh vllm     stage, install if needed, bench/gpu_grpo.py vllm
#   scripts/gpu/device_run.sh train    bench/gpu_grpo.py train (trainer MFU): carrying .whl/tt
#                                      alone (TorchTitan and its imports) is enough, no staging
#   scripts/gpu/device_run.sh push     stage, install if needed, weight-path GPU tests + bench
#   scripts/gpu/device_run.sh trl      stage, install if needed (stack, then TRL), bench/trl_grpo.py
#   scripts/gpu/device_run.sh side-by-side on|off [GPUS]  stage, install if needed (stack, then
#                                      TRL), then forgesky's plan for GPUS (default 1) through
#                                      bench/gpu_grpo.py grpo and TRL tuned through
#                                      bench/trl_grpo.py, one after the other, on-policy (on) or
#                                      one step off-policy (off), each in a time limit of its own
#                                      (TRL on GPUS > 1: torchrun, a process and a vLLM a GPU)
#                                      (SBS_OURS_S, default 330; SBS_TRL_S, 200), both with TRL's
#                                      reward; one JSON, a log per run; SBS_RUNS=ours or trl
#                                      runs one of the two, SBS_RUNS="ours alone trl" also vLLM
#                                      alone on GPU 0 after ours (SBS_ALONE_S, 200);
#                                      SBS_OURS_ARGS: more arguments for ours (--set K=V);
#                                      SBS_TRL_MB="32 16": TRL's micro-batches to try, largest
#                                      first, the first that runs to its end is kept
#   scripts/gpu/device_run.sh verl [ARGS]  stage, install if needed (stack, then verl's
#                                      environment, /tmp/verl-env), bench/verl_grpo.py there
#   scripts/gpu/device_run.sh pairs on|off|sft [GPUS] [PEER ARGS]  stage, install if needed (stack,
#                                      then TRL or verl), then the next PAIRS_RUNS (1) runs of the
#                                      alternating order ours, peer, ours, peer, ... (PAIRS_N
#                                      pairs, 3) with the side-by-side mode's command lines, each
#                                      into its section of /tmp/bench/pairs$TAG.json (pair1_ours,
#                                      pair1_peer, ...) stamped with start, end, exit code, host
#                                      and commit by bench/pairs.py, the JSON copied to $OUT after
#                                      each; `pairs --dry-run ...` prints the next run, no more;
#                                      `pairs sft [GPUS] [TRL ARGS]`: SFT, forgesky
#                                      (bench/gpu_sft.py) against TRL's SFTTrainer
#                                      (bench/trl_sft.py), peer trl-sft (SFT_RECIPE, SFT_STEPS,
#                                      SFT_WARMUP; SBS_OURS_S 300 and SBS_TRL_S 240 a run)
#   scripts/gpu/device_run.sh tools [GPUS]  stage, install if needed, bench/gpu_tools.py: the
#                                      plan of qwen3-1.7b-tools for GPUS (default 1), random
#                                      weights, a tool that takes 100 ms a call, through
#                                      `python -m runtime`; stopped (and still summarized) after
#                                      TOOLS_LIMIT_S (default 540); gpu_tools$TAG.json, the run's
#                                      log tools_run$TAG.log
#   scripts/gpu/device_run.sh cpus [ARGS]  stage, install if needed, then vLLM alone
#                                      (bench/gpu_grpo.py vllm --calls-only ARGS) in one process a
#                                      word of CPUS_RUNS (default "none none none"): none,
#                                      a --cpus spec (node, cores, node-cores, a list) with
#                                      CPUS_CALLS calls (6), or sweep (one call with
#                                      the engine's thread on each CPU in turn); each in CPUS_RUN_S
#                                      (120; a sweep 4 s a CPU more) and none past CPUS_BY (epoch
#                                      s; default 540 s after the install); a log a
#                                      process, gpu_grpo_cpus$TAG.json, and bench/cpu_runs.py's
#                                      table (cpus_table$TAG.md); `cpus --dry-run` prints the runs
#   scripts/gpu/device_run.sh product  stage, install if needed, bench/product_path.py (a catalog
#                                      recipe at full size: load, train, checkpoint, kill, resume,
#                                      export, serve); its JSON and the runs' logs go to $OUT
# A group's log, and `tests`', starts with `commit: HASH`: COMMIT=<hash> (the caller's `git rev-parse HEAD`:
# the checkout there may have no .git), else git's answer here. `suite` shares out SUITE_GPUS
# (default CUDA_VISIBLE_DEVICES, else every GPU of the host, in nvidia-smi's numbering) and
# stops a group after SUITE_GROUP_S s (default 530: its log still comes back within the call).
# Extra arguments go to pytest, bench/gpu_grpo.py or bench/trl_grpo.py. Logs and results land in
# $OUT (the folder whose files come back), else /tmp/out. Runs side by side on one host: give
# each its GPUs (CUDA_VISIBLE_DEVICES, which the runtime's plans index into) and a TAG that keeps
# its JSON and logs apart (gpu_grpo$TAG.json, bench_<mode>$TAG.log), after one `check` call has
# installed the stack. Chunks come from
# scripts/gpu/prepare_wheels.sh (.whl/cNN, .whl/ts), scripts/gpu/prepare_trl_wheels.sh
# (.whl/trl or .whl/trl0, .whl/trl1, ...), scripts/gpu/prepare_extra_wheels.sh (.whl/env: OpenEnv
# for `tools`) and scripts/gpu/prepare_verl_wheels.sh (.whl/verl0,
# .whl/verl1, .whl/verl2); every mode stages whichever a call carries.
# scripts/gpu/README.md has the call sequence.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-check}
shift || true
out=${OUT:-/tmp/out}
tag=${TAG:-}
json=/tmp/bench/gpu_grpo$tag.json
verl_py=/tmp/verl-env/bin/python # verl's environment (install_verl)
mkdir -p "$out"
# PACK_BY=<epoch seconds> (e.g. $(( $(date +%s) + 560 )) at a call's start, 40 s inside its
# limit): this run's logs go to a folder of their own and come back as one file,
# $OUT/logs$TAG.tgz, with the run's JSON beside it, packed when the run ends or at PACK_BY,
# whichever comes first. A call cut at its limit returns only what is in $OUT by then, and $OUT
# returns at most 8 files.
if [ -n "${PACK_BY:-}" ]; then
  back=$out
  out=/tmp/pack$tag
  mkdir -p "$out"
  pack() {
    tar czf "$back/logs$tag.tgz" -C "$out" . 2>/dev/null || true
    cp /tmp/bench/*"$tag".json "$back/" 2>/dev/null || true
  }
  wait_s=$((PACK_BY - $(date +%s)))
  # The waiting packer holds none of this script's output: `... check | tail` returns when the
  # check does, not at PACK_BY (its sleep outlives the subshell that the trap kills).
  (sleep $((wait_s > 0 ? wait_s : 0)) && pack) </dev/null >/dev/null 2>&1 &
  packer=$!
  trap 'kill "$packer" 2>/dev/null || true; pack' EXIT
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# No network there: nothing should wait on one (usage stats, Hub lookups, W&B).
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
# NVLink multicast stays off on shared hosts (harmless where there is none).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The commit each log names: COMMIT=<the hash sent>. Without it, git's HEAD only where the files
# are HEAD's: a machine's copy can carry a .git whose HEAD is not the tree sent (one named
# 0a9c205 for a tree of 414e40d on 2026-11-29).
commit=${COMMIT:-}
if [ -z "$commit" ]; then
  if git diff --quiet HEAD 2>/dev/null; then
    commit=$(git rev-parse HEAD)
  else
    commit="unknown (set COMMIT=)"
  fi
fi

# One group of the GPU suite on the GPUs CUDA_VISIBLE_DEVICES gives it (numbered as nvidia-smi
# numbers them), into $out/gpu_suite_GROUP.log, which names the commit first. Its own pytest
# temporary folder; ports are free ones each run picks: groups run side by side on one host.
group_command() { # sets `command`, the group's pytest command line
  local group=$1
  shift
  local listed
  listed=$(python3 scripts/gpu/suite.py tests "$group") || return 2
  local tests
  mapfile -t tests <<<"$listed"
  command=(timeout -s INT -k 30 "${SUITE_GROUP_S:-530}" python3 -m pytest -q -m gpu -s
    -p no:cacheprovider --timeout 540 --durations=0 "--basetemp=/tmp/gpu_suite_$group"
    "${tests[@]}" "$@")
}

run_group() {
  local group=$1
  shift
  group_command "$group" "$@" || return 2
  {
    echo "commit: $commit"
    echo "group: $group on GPUs ${CUDA_VISIBLE_DEVICES:-all} of ${HOSTNAME:-this host}"
    CUDA_DEVICE_ORDER=PCI_BUS_ID "${command[@]}"
  } >"$out/gpu_suite_$group.log" 2>&1
}

# `suite [--dry-run] GROUP...`: the groups at once, each on as many of the GPUs as it needs, a
# wave at a time where they do not all fit; exit 1 if any failed.
run_suite() {
  local dry=0
  if [ "${1:-}" = --dry-run ]; then
    dry=1
    shift
  fi
  local listed=${SUITE_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
  [ -n "$listed" ] || listed=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)
  local pool free pids=() names=() status=0 group need gpus
  IFS=, read -r -a pool <<<"$listed"
  free=("${pool[@]}")
  finish_wave() {
    local i
    for i in "${!pids[@]}"; do
      if wait "${pids[$i]}"; then
        echo "suite: ${names[$i]} passed"
      else
        echo "suite: ${names[$i]} failed"
        status=1
      fi
      tail -n 2 "$out/gpu_suite_${names[$i]}.log"
    done
    pids=()
    names=()
    free=("${pool[@]}")
  }
  for group in "$@"; do
    need=$(python3 scripts/gpu/suite.py gpus "$group") || return 2
    if [ "$need" -gt "${#pool[@]}" ]; then
      echo "suite: $group needs $need GPUs, and ${#pool[@]} are given ($listed)" >&2
      return 2
    fi
    [ "$need" -le "${#free[@]}" ] || finish_wave
    gpus=$(IFS=,; echo "${free[*]:0:$need}")
    free=("${free[@]:$need}")
    echo "suite: $group on GPUs $gpus, log gpu_suite_$group.log"
    if [ "$dry" = 1 ]; then
      group_command "$group"
      echo "  commit: $commit"
      echo "  CUDA_VISIBLE_DEVICES=$gpus ${command[*]}"
    else
      CUDA_VISIBLE_DEVICES=$gpus run_group "$group" &
      pids+=($!)
      names+=("$group")
    fi
  done
  finish_wave
  return $status
}

# The two systems' command lines for a side-by-side or a pair, on-policy (on) or one step off
# (off) on GPUS: sets `ours` (bench/gpu_grpo.py grpo), `trl` (bench/trl_grpo.py) and `launch`
# (what starts TRL: torchrun on GPUS > 1, a process and a vLLM a GPU).
sbs_args() {
  local policy=$1 gpus=$2
  # TRL's reward (bench/rewards.py) for ours too; the task's math reward weighted 0 stays,
  # as the eval's reward must be one of the run's.
  local reward="dataset.rewards=[{name: math, weight: 0.0}, {name: 'bench.rewards:distinct_share', weight: 1.0}]"
  ours=(--gpus "$gpus" --steps 6 --warmup 2 --set "$reward")
  # SBS_OURS_ARGS: more arguments for ours, e.g. "--set layout.reference.spread=true"
  local more
  read -r -a more <<<"${SBS_OURS_ARGS:-}"
  ours+=("${more[@]}")
  # SBS_SPY=1: ours and vLLM alone record every process's stacks (bench/stacks.py; py-spy
  # installed from .whl/spy) over the measured steps and the timed calls, raw files to $out
  spy=()
  [ -z "${SBS_SPY:-}" ] || spy=(--py-spy "$out" --tag "$tag")
  ours+=("${spy[@]}")
  trl=(--prompt-tokens 207 --steps 6 --warmup 2 --is-correction off --micro-batch 16
    --vllm-memory 0.3 --gradient-checkpointing on)
  # verl (bench/verl_grpo.py): on-policy, main_ppo's hybrid engine; one step off, verl's
  # one_step_off_policy trainer (vLLM on GPUs of its own: two or more), on one GPU verl's
  # colocated asynchronous trainer (colocate-async)
  verl=(--gpus "$gpus" --steps 6 --warmup 2)
  case "$policy" in
    on) ours+=(--set grpo.max_policy_age=0) ;;
    off) trl+=(--optimizer-steps-per-generation 2) ;;
    *) echo "$mode: on or off (GRPO) or sft, not $policy" >&2; return 2 ;;
  esac
  case "$gpus" in
    '' | *[!0-9]* | 0) echo "$mode: a GPU count of 1 or more, not $gpus" >&2; return 2 ;;
  esac
  case "$policy:$gpus" in
    on:*) verl+=(--policy on) ;;
    off:1) verl+=(--policy colocate-async) ;;
    off:*) verl+=(--policy off) ;;
  esac
  launch=(python3)
  if [ "$gpus" -gt 1 ]; then
    launch=(python3 -m torch.distributed.run --nproc_per_node "$gpus"
      --master_port "${MASTER_PORT:-29611}")
  fi
}

# The SFT pair's command lines on GPUS: `ours`, bench/gpu_sft.py (`python -m runtime` on the SFT
# recipe's plan, SFT_RECIPE, default qwen3-1.7b-sft), `trl`, bench/trl_sft.py (TRL's SFTTrainer
# on the same model folder, chats, lengths and tokens a step), and `launch` (torchrun on GPUS > 1).
# Both sides share /dev/shm/sft-bench: the first run writes the model folder, the others reuse it.
sft_args() {
  local gpus=$1
  case "$gpus" in
    '' | *[!0-9]* | 0) echo "$mode: a GPU count of 1 or more, not $gpus" >&2; return 2 ;;
  esac
  local recipe=${SFT_RECIPE:-qwen3-1.7b-sft} steps=${SFT_STEPS:-5} warmup=${SFT_WARMUP:-2}
  ours=(--recipe "$recipe" --gpus "$gpus" --steps "$steps" --warmup "$warmup")
  local more
  read -r -a more <<<"${SBS_OURS_ARGS:-}"
  ours+=("${more[@]}")
  trl=(--recipe "$recipe" --steps "$steps" --warmup "$warmup")
  launch=(python3)
  if [ "$gpus" -gt 1 ]; then
    launch=(python3 -m torch.distributed.run --nproc_per_node "$gpus"
      --master_port "${MASTER_PORT:-29611}")
  fi
}

# `pairs [--dry-run] on|off|sft [GPUS] [PEER ARGS]`: the next PAIRS_RUNS runs (default 1) of the
# alternating order ours, peer, ours, peer, ... (bench/pairs.py), each into its own section of
# /tmp/bench/pairs$TAG.json (pair1_ours, pair1_peer, ...) stamped with its start, end, exit
# code, host and commit, the JSON copied to $out after every run. `sft` compares SFT instead:
# bench/gpu_sft.py against bench/trl_sft.py (sft_args), peer trl-sft. The JSON lives while the
# machine stays up: one TAG, one comparison, one host. PAIRS_N (3): the pairs to make;
# PAIRS_PEER (trl): the peer's name in the records (trl-lora where PEER ARGS give
# --lora-rank; verl: bench/verl_grpo.py in verl's environment, each run in SBS_VERL_S, 420 s,
# PEER ARGS to it); PAIRS_SIDE=ours|peer: refuse (exit 2) unless the call's first run is of that
# side. A run that
# fails ends the call; the next call makes it again.
run_pairs() {
  local dry=0
  if [ "${1:-}" = --dry-run ]; then
    dry=1
    shift
  fi
  local policy=${1:-} gpus=${2:-1}
  shift 2 || shift $#
  local peer=${PAIRS_PEER:-trl}
  if [ "$policy" = sft ]; then
    sft_args "$gpus" || return 2
    peer=${PAIRS_PEER:-trl-sft}
  else
    sbs_args "$policy" "$gpus" || return 2
  fi
  case "$peer" in
    trl | trl-*) ;;
    verl)
      if [ "$policy" = sft ]; then
        echo "pairs: verl is a GRPO peer (on or off), not an SFT one" >&2
        return 2
      fi
      ;;
    *) echo "pairs: no launcher for the peer $peer in bench/ (trl, trl-lora, verl, ...)" >&2; return 2 ;;
  esac
  local json=/tmp/bench/pairs$tag.json n=${PAIRS_N:-3} runs=${PAIRS_RUNS:-1} i slot k side
  local section log rc started status=0
  if [ "$dry" = 0 ] && [ "$peer" = verl ]; then
    { install && check && install_verl; } || return 3
  elif [ "$dry" = 0 ]; then
    { install && check && install_trl; } || return 3
  fi
  mkdir -p /tmp/bench
  for ((i = 0; i < runs; i++)); do
    slot=$(python3 bench/pairs.py next --json "$json" --pairs "$n") || return 2
    if [ "$slot" = done ]; then
      echo "pairs: all $n pairs of $json are done"
      break
    fi
    read -r k side <<<"$slot"
    if [ "$i" = 0 ] && [ -n "${PAIRS_SIDE:-}" ] && [ "$PAIRS_SIDE" != "$side" ]; then
      echo "pairs: PAIRS_SIDE=$PAIRS_SIDE, but the order calls for pair $k $side" >&2
      return 2
    fi
    section=pair${k}_$side
    log="$out/pairs_${section}$tag.log"
    if [ "$side" = ours ] && [ "$policy" = sft ]; then
      command=(timeout -s TERM -k 90 "${SBS_OURS_S:-300}" python3 bench/gpu_sft.py --out "$json"
        "${ours[@]}" --section "$section")
    elif [ "$side" = ours ]; then
      command=(timeout -s TERM "${SBS_OURS_S:-330}" python3 bench/gpu_grpo.py grpo --out "$json"
        "${ours[@]}" --section "$section")
    elif [ "$peer" = verl ]; then
      # verl's own Ray cluster, in the environment layered over the stack's (install_verl)
      command=(timeout -s TERM -k 30 "${SBS_VERL_S:-420}" "$verl_py" bench/verl_grpo.py
        --out "$json" "${verl[@]}" --section "$section" "$@")
    elif [ "$policy" = sft ]; then
      command=(env MASTER_PORT="${MASTER_PORT:-29611}" timeout -s TERM -k 30 "${SBS_TRL_S:-240}"
        "${launch[@]}" bench/trl_sft.py --out "$json" "${trl[@]}" "$@" --section "$section")
    else
      command=(env MASTER_PORT="${MASTER_PORT:-29611}" timeout -s TERM "${SBS_TRL_S:-200}"
        "${launch[@]}" bench/trl_grpo.py --out "$json" "${trl[@]}" "$@" --section "$section")
    fi
    echo "pairs: pair $k, $side, log $(basename "$log")"
    if [ "$dry" = 1 ]; then
      echo "  ${command[*]}"
      break
    fi
    started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    rc=0
    "${command[@]}" >"$log" 2>&1 || rc=$?
    python3 bench/pairs.py stamp --json "$json" --pair "$k" --side "$side" \
      --system "$([ "$side" = ours ] && echo forgesky || echo "$peer")" --started "$started" \
      --ended "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --exit-code "$rc" --commit "$commit" \
      --tag "$tag" || status=2
    cp "$json" "$out/" 2>/dev/null || true
    grep -h "^step \|samples_per_s_per_gpu\|tokens/s per GPU\|error" "$log" | tail -8 || true
    if [ "$rc" -ne 0 ] || [ "$status" -ne 0 ]; then
      echo "pairs: pair $k $side: exit $rc; the next call makes it again"
      return $((status || rc))
    fi
  done
}

# Modes that need nothing staged or installed.
# `cpus [--dry-run] [ARGS]`: vLLM alone in a process of its own for each word of CPUS_RUNS, the
# table of their calls by the CPUs their engine thread ran on at the end.
run_cpus() {
  local dry=0
  if [ "${1:-}" = --dry-run ]; then
    dry=1
    shift
  fi
  local runs=${CPUS_RUNS:-none none none} calls=${CPUS_CALLS:-6}
  local limit=${CPUS_RUN_S:-120} by left
  local json=/tmp/bench/gpu_grpo_cpus$tag.json i=0 spec section log more run_s status=0 rc
  for spec in $runs; do
    case "$spec" in
      none | node | cores | node-cores | sweep | [0-9]*) ;;
      *)
        echo "cpus: $spec in CPUS_RUNS: none, node, cores, node-cores, sweep or a CPU list" >&2
        return 2
        ;;
    esac
  done
  if [ "$dry" = 0 ]; then
    { install && check; } || return 3
    rm -f "$json"
  fi
  by=${CPUS_BY:-$(($(date +%s) + 540))}
  mkdir -p /tmp/bench
  for spec in $runs; do
    i=$((i + 1))
    section=cpus_${i}_$spec
    log="$out/$section$tag.log"
    run_s=$limit
    if [ "$spec" = sweep ]; then
      more=(--calls 1 --cpu-sweep)
      run_s=$((limit + 4 * $(nproc)))
    else
      more=(--calls "$calls" --cpus "$spec")
    fi
    left=$((by - $(date +%s)))
    if [ "$left" -lt 90 ]; then
      echo "cpus: $section not started: ${left} s left before CPUS_BY, a process needs 90"
      continue
    fi
    [ "$left" -ge "$run_s" ] || run_s=$left
    # a process's string hashes seeded by its number: one whose speed follows its seed can be
    # made again
    command=(env PYTHONHASHSEED="$i" timeout -s TERM -k 20 "$run_s" python3 bench/gpu_grpo.py
      vllm --calls-only --speed-probe --out "$json" --section "$section" "${more[@]}" "$@")
    echo "cpus: $section, log $(basename "$log")"
    if [ "$dry" = 1 ]; then
      echo "  ${command[*]}"
      continue
    fi
    rc=0
    "${command[@]}" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "cpus: $section exit $rc"
      tail -n 3 "$log"
      status=1
    fi
    cp "$json" "$out/" 2>/dev/null || true
  done
  if [ "$dry" = 0 ] && [ -f "$json" ]; then
    python3 bench/cpu_runs.py "$json" | tee "$out/cpus_table$tag.md"
  fi
  return $status
}

case "$mode" in
  groups)
    python3 scripts/gpu/suite.py list
    exit
    ;;
  suite | pairs | cpus)
    if [ "${1:-}" = --dry-run ]; then
      case "$mode" in
        suite) run_suite "$@" ;;
        pairs) run_pairs "$@" ;;
        cpus) run_cpus "$@" ;;
      esac
      exit
    fi
    ;;
esac

stage() {
  mkdir -p /tmp/asm/ts
  for d in .whl/c[0-9]*; do
    if [ -d "$d" ]; then cp "$d"/part_* /tmp/asm/ && echo "staged $d"; fi
  done
  if [ -d .whl/ts ]; then cp .whl/ts/*.whl /tmp/asm/ts/; fi
  echo "in /tmp/asm: $(cd /tmp/asm && ls part_* 2>/dev/null | tr '\n' ' ')"
  # TRL's wheels are whole wheels (no tar): they go straight to pip.
  mkdir -p /tmp/asm_trl
  for d in .whl/trl*; do
    if [ -d "$d" ]; then cp "$d"/*.whl /tmp/asm_trl/ && echo "staged $d"; fi
  done
  # OpenEnv and FastMCP for the tools runs (.whl/env: whole wheels, like TRL's).
  mkdir -p /tmp/asm_env
  for d in .whl/env*; do
    if [ -d "$d" ]; then cp "$d"/*.whl /tmp/asm_env/ && echo "staged $d"; fi
  done
  # verl's parts (.whl/verl0, .whl/verl1, .whl/verl2: one tar split, like the stack's chunks).
  mkdir -p /tmp/asm_verl
  for d in .whl/verl[0-9]*; do
    if [ -d "$d" ]; then cp "$d"/part_* /tmp/asm_verl/ && echo "staged $d"; fi
  done
  # py-spy (.whl/spy, scripts/gpu/README.md): the bench's --py-spy records stacks with it.
  if [ -d .whl/spy ] && ! command -v py-spy >/dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/spy/*.whl && echo "installed py-spy"
  fi
}

install_trainer() {
  # The trainer alone: TorchTitan and what it imports (.whl/tt, carried in this call), else the
  # whole staged stack.
  python3 -c "import torchtitan, tyro, pydantic" >/dev/null 2>&1 && return 0
  if ls .whl/tt/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/tt/*.whl
  else
    install
  fi
}

installed() {
  python3 -c "import vllm, monarch, torchtitan, torchstore, pygtrie" >/dev/null 2>&1
}

install() {
  installed && return 0
  if ! ls /tmp/asm/ts/*.whl >/dev/null 2>&1; then
    echo "torchstore wheel missing: carry .whl/ts in this call" >&2
    exit 3
  fi
  cat /tmp/asm/part_* >/tmp/w.tar
  if ! tar xf /tmp/w.tar -C /tmp; then
    echo "wheel chunks incomplete (carry every .whl/cNN first)" >&2
    exit 3
  fi
  rm -f /tmp/w.tar
  start=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile /tmp/wheels/*.whl /tmp/asm/ts/*.whl
  echo "installed in $(($(date +%s) - start)) s"
}

# Whole wheels staged under /tmp/asm_NAME, installed unless the import check ($2) passes
# already; $3 says what to carry where they are missing.
install_staged() {
  python3 -c "$2" >/dev/null 2>&1 && return 0
  if ! ls "/tmp/asm_$1"/*.whl >/dev/null 2>&1; then
    echo "$3 in this call or an earlier one" >&2
    exit 3
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile "/tmp/asm_$1"/*.whl
}

install_trl() {
  install_staged trl "import trl, datasets, accelerate" \
    "TRL wheels missing: carry .whl/trl (scripts/gpu/prepare_trl_wheels.sh)"
  python3 -c "import trl; print('trl', trl.__version__)"
}

install_env() {
  install_staged env "import openenv, fastmcp.server" \
    "OpenEnv wheels missing: carry .whl/env (scripts/gpu/prepare_extra_wheels.sh env openenv==0.6.0 mcp==1.30.0)"
  python3 -c "import openenv, fastmcp.server, fastmcp; print('openenv, fastmcp', fastmcp.__version__)"
}

# verl's environment: a venv at /tmp/verl-env whose own site-packages (verl, ray, transformers
# 5.9.0, ... from .whl/verl0, verl1, verl2) come first and whose .pth then adds the image's
# site-packages, with the stack installed in it (torch, vLLM 0.24.0, ...): python3 here is
# itself a venv, so --system-site-packages would reach the base interpreter's, not these.
# Wheels go in with --target, the image's pip, no index, no dependencies (all resolved by
# scripts/gpu/prepare_verl_wheels.sh).
install_verl() {
  "$verl_py" -c "import verl, ray, transfer_queue" >/dev/null 2>&1 && return 0
  if ! cat /tmp/asm_verl/part_* 2>/dev/null | tar xf - -C /tmp; then
    echo "verl wheels incomplete: carry every .whl/verlN (scripts/gpu/prepare_verl_wheels.sh), one a call" >&2
    exit 3
  fi
  local start image site
  start=$(date +%s)
  rm -rf /tmp/verl-env
  python3 -m venv --without-pip /tmp/verl-env
  image=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site=$("$verl_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$image')" >"$site/zz_stack.pth"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" /tmp/verl-wheels/*.whl
  "$verl_py" - <<'PY'
import importlib.metadata as m, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
names = ("verl", "ray", "transformers", "tokenizers", "tensordict", "transferqueue", "vllm", "torch")
print("verl env", sys.executable, {n: version(n) for n in names})
PY
  echo "verl installed in $(($(date +%s) - start)) s"
}

check() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib.metadata as m, platform, torch
names = ("torch", "vllm", "torchmonarch", "torchstore", "torchtitan", "transformers", "triton")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print("python", platform.python_version(), {n: version(n) for n in names})
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count())
EOF
}

stage
case "$mode" in
  stage) ;;
  check) install && check ;;
  suite)
    install && check
    run_suite "$@"
    ;;
  tests)
    if [ -n "${1:-}" ] && python3 scripts/gpu/suite.py gpus "$1" >/dev/null 2>&1; then
      group=$1
      shift
      install && check
      status=0
      run_group "$group" "$@" || status=$?
      tail -n 40 "$out/gpu_suite_$group.log"
      exit "$status"
    fi
    # What `make test-gpu GPU_PY=python3` runs: every gpu-marked test (two-GPU ones skip on one).
    # Its log names the commit first, as a group's does.
    install && check
    echo "commit: $commit" >"$out/gpu_tests$tag.log"
    if command -v make >/dev/null; then
      make test-gpu GPU_PY=python3 ARGS="-s -p no:cacheprovider --timeout 540 $*" 2>&1 \
        | tee -a "$out/gpu_tests$tag.log"
    else
      python3 -m pytest -q -m gpu -s -p no:cacheprovider --timeout 540 "$@" 2>&1 \
        | tee -a "$out/gpu_tests$tag.log"
    fi
    ;;
  faults)
    # The GPU faults caused for real (tests/test_gpu_faults.py): each test prints
    # `fault-exit NAME S s`; the log comes back as gpu_faults$TAG.log.
    install && check
    python3 -m pytest -q -m gpu -s -p no:cacheprovider --timeout 400 tests/test_gpu_faults.py \
      "$@" 2>&1 | tee "$out/gpu_faults$tag.log"
    ;;
  trainer-tests)
    # The trainer's GPU tests alone: TorchTitan only (.whl/tt), no staging.
    install_trainer && check
    python3 -m pytest -q -m gpu -s -p no:cacheprovider --timeout 540 \
      tests/test_gpu_trainer.py "$@" 2>&1 | tee "$out/gpu_tests_trainer$tag.log"
    ;;
  grpo | vllm | train)
    if [ "$mode" = train ]; then install_trainer; else install; fi
    check
    # $OUT starts empty every time: the JSON both modes merge into lives in /tmp.
    mkdir -p /tmp/bench
    status=0
    python3 bench/gpu_grpo.py "$mode" --out "$json" "$@" 2>&1 |
      tee "$out/bench_$mode$tag.log" || status=$?
    cp "$json" "$out/" 2>/dev/null || true
    exit "$status"
    ;;
  push)
    # The weight paths: GPU tests (NCCL push between GPUs 0 and 1, CUDA IPC on GPU 0, the store
    # path from GPU tensors, a TP=2 vLLM engine loading from a flat buffer), then
    # bench/weight_push.py (push, ipc, store) for each model named in $@ (default qwen3-1.7b
    # qwen3-8b).
    install && check
    mkdir -p /tmp/bench
    status=0
    python3 -m pytest -q -m gpu -s -p no:cacheprovider --timeout 300 \
      tests/test_gpu_weight_sync.py tests/test_gpu_trainer_ranks.py tests/test_gpu_vllm_tp.py 2>&1 |
      tee "$out/gpu_tests_weight_sync$tag.log" || status=$?
    for model in ${@:-qwen3-1.7b qwen3-8b}; do
      python3 bench/weight_push.py --model "$model" --paths push,ipc,store --out "$json" 2>&1 |
        tee -a "$out/bench_push$tag.log" || status=$?
    done
    cp "$json" "$out/" 2>/dev/null || true
    exit "$status"
    ;;
  side-by-side)
    # Extra arguments after the policy mode and the GPU count go to bench/trl_grpo.py (e.g.
    # --gradient-checkpointing off where memory allows it: an H200).
    policy=${1:?on or off}
    gpus=${2:-1}
    shift 2 || shift $#
    sbs_args "$policy" "$gpus" || exit 2
    install && check
    # SBS_RUNS (default "ours trl"): one of them alone, where a call's time holds only one
    # (the JSON in /tmp/bench gathers both while the machine stays up); TRL's wheels are
    # needed only where TRL runs.
    runs=${SBS_RUNS:-ours trl}
    [[ " $runs " != *" trl "* ]] || install_trl
    mkdir -p /tmp/bench
    json=/tmp/bench/side_by_side$tag.json
    status=0
    if [[ " $runs " == *" ours "* ]]; then
      # its log names the commit first, as a group's does
      echo "commit: $commit" >"$out/side_by_side_grpo_${gpus}gpu_${policy}$tag.log"
      timeout -s TERM "${SBS_OURS_S:-330}" python3 bench/gpu_grpo.py grpo --out "$json" \
        "${ours[@]}" --section "grpo_${gpus}gpu_${policy}_policy" \
        >>"$out/side_by_side_grpo_${gpus}gpu_${policy}$tag.log" 2>&1 || status=$?
      echo "forgesky ${policy}-policy: exit $status"
      cp "$json" "$out/" 2>/dev/null || true
      grep -h "^step \|error" "$out/side_by_side_grpo_${gpus}gpu_${policy}$tag.log" | tail -8 || true
    fi
    if [[ " $runs " == *" alone "* ]]; then
      # vLLM alone on GPU 0, the same prompts, sampling and sequences a call as the
      # off-policy plan's generator, into the same JSON: its section gets
      # generation_to_standalone, in-loop against alone on one host (compile cache warm from
      # ours)
      # SBS_ALONE_ARGS: more arguments for it (e.g. "--calls 8")
      read -r -a alone <<<"${SBS_ALONE_ARGS:-}"
      CUDA_VISIBLE_DEVICES=0 timeout -s TERM "${SBS_ALONE_S:-200}" python3 bench/gpu_grpo.py \
        vllm --out "$json" "${alone[@]}" "${spy[@]}" >"$out/side_by_side_vllm_alone$tag.log" 2>&1 ||
        status=$?
      echo "vLLM alone: exit $status"
      cp "$json" "$out/" 2>/dev/null || true
      tail -3 "$out/side_by_side_vllm_alone$tag.log" || true
    fi
    rc=0
    [[ " $runs " == *" trl "* ]] || exit "$status"
    # SBS_TRL_MB (e.g. "32 16"): micro-batches to try, largest first, each in a process of its
    # own; the first that runs to its end writes the section ("the largest micro-batch that
    # fits"), each try's log and exit code stay in $out.
    for mb in ${SBS_TRL_MB:-keep}; do
      more=()
      [ "$mb" = keep ] || more=(--micro-batch "$mb")
      log="$out/side_by_side_trl_${policy}$tag${more:+_mb$mb}.log"
      rc=0
      MASTER_PORT=${MASTER_PORT:-29611} timeout -s TERM "${SBS_TRL_S:-200}" \
        "${launch[@]}" bench/trl_grpo.py --out "$json" "${trl[@]}" "$@" "${more[@]}" \
        --section "trl_tuned_${policy}_policy" >"$log" 2>&1 || rc=$?
      echo "TRL ${policy}-policy${more:+ micro-batch $mb}: exit $rc" | tee -a "$out/trl_tries$tag.txt"
      [ "$rc" -eq 0 ] && break
    done
    cp "$json" "$out/" 2>/dev/null || true
    tail -4 "$log" || true
    exit $((status || rc))
    ;;
  pairs)
    run_pairs "$@"
    ;;
  cpus)
    run_cpus "$@"
    ;;
  product)
    install && check
    df -h / /tmp /dev/shm
    free -g | head -2
    # What a checkpoint write can expect of this disk: 4 GiB written and flushed.
    dd if=/dev/zero of=/tmp/disk_probe bs=64M count=64 conv=fsync 2>&1 | tail -1
    rm -f /tmp/disk_probe
    # PRODUCT_LIMIT_S (default 560 s, under a call's 600 s): the bench is stopped with SIGTERM
    # and still kills its run and writes its JSON; the runs' logs grow line by line in $out.
    status=0
    timeout -s TERM "${PRODUCT_LIMIT_S:-560}" \
      python3 bench/product_path.py --out "$out/product_path$tag.json" "$@" 2>&1 |
      tee "$out/bench_product$tag.log" || status=$?
    exit "$status"
    ;;
  tools)
    # Multi-turn tool use: extra arguments after the GPU count go to bench/gpu_tools.py
    # (--steps, --tool-s, --max-turns, --turn-tokens, --set KEY=VALUE).
    gpus=${1:-1}
    shift || true
    install && check && install_env
    mkdir -p /tmp/bench
    json=/tmp/bench/gpu_tools$tag.json
    status=0
    timeout -s TERM -k 60 "${TOOLS_LIMIT_S:-540}" python3 bench/gpu_tools.py --gpus "$gpus" \
      --out "$json" --log "$out/tools_run$tag.log" --work /tmp/gpu-tools-bench$tag "$@" 2>&1 |
      tee "$out/bench_tools$tag.log" || status=$?
    cp "$json" "$out/" 2>/dev/null || true
    exit "$status"
    ;;
  verl)
    # bench/verl_grpo.py in verl's environment: a "verl" section in the JSON (or --section),
    # verl's output in the log. Arguments go to it (--gpus 2 --policy off, Hydra key=value).
    install && check
    install_verl
    mkdir -p /tmp/bench
    status=0
    "$verl_py" bench/verl_grpo.py --out "$json" "$@" 2>&1 | tee "$out/bench_verl$tag.log" ||
      status=$?
    cp "$json" "$out/" 2>/dev/null || true
    exit "$status"
    ;;
  trl)
    install && check
    install_trl
    mkdir -p /tmp/bench
    status=0
    python3 bench/trl_grpo.py --out "$json" "$@" 2>&1 |
      tee "$out/bench_trl$tag.log" || status=$?
    cp "$json" "$out/" 2>/dev/null || true
    exit "$status"
    ;;
  *)
    echo "unknown mode $mode (stage, check, tests, suite, groups, faults, trainer-tests, push, grpo, vllm, train, trl, verl, side-by-side, pairs, product, tools)" >&2
    exit 2
    ;;
esac
