"""Measured speeds the planner's cost model starts from (recipes/costs.py).

Written by `python bench/cost_constants.py` from the committed runs under bench/results;
do not edit: add a run to its SOURCES and write this file again (a test checks that it
is up to date)."""

MEASURED = {
    "batch_exponent": 0.317,
    "batch_source": "bench/results/gpu_grpo_h200x4_2026-11-22.json#grpo_3gpu vs bench/results/gpu_grpo_h200x4_2026-11-22.json#grpo_3gpu_2steps_per_call",
    "lora": {
        "generate_share": 0.781,
        "load_s": 0.0509,
        "reference_time_share": 0.841,
        "source": "bench/results/gpu_h200_2026-11-29-lora/side_by_side_lora8b.json#grpo_1gpu_on_policy against H200 qwen3-8b",
        "train_time_share": 0.623
    },
    "rates": {
        "H200": {
            "llama3.1-8b": {
                "generate_tok_s": 5444.3,
                "params": 8030261248,
                "reference_tok_s": 33318.3,
                "sequences_per_call": 32,
                "source": "bench/results/gpu_grpo_h200x4.json#grpo_llama3_1_8b_4gpu",
                "train_checkpointing": True,
                "train_tok_s": 7161.7
            },
            "qwen3-1.7b": {
                "generate_tok_s": 25679.9,
                "params": 1720574976,
                "reference_tok_s": 132826.3,
                "sequences_per_call": 128,
                "source": "bench/results/gpu_grpo_h200x4_2026-11-22.json#grpo_3gpu",
                "train_checkpointing": False,
                "train_tok_s": 42056.7
            },
            "qwen3-8b": {
                "generate_tok_s": 12140.0,
                "params": 8190735360,
                "reference_tok_s": 29748.4,
                "sequences_per_call": 96,
                "source": "bench/results/gpu_grpo_h200x4.json#grpo_qwen3_8b_4gpu",
                "train_checkpointing": True,
                "train_tok_s": 7316.1
            }
        }
    },
    "sft_startup": {
        "runs": 3,
        "share_of_grpo": 0.413,
        "source": "bench/cost_constants.py SFT_STARTUP_SOURCES",
        "spread_s": [
            52.3,
            92.8
        ]
    },
    "size_exponent": 0.422,
    "size_source": "H200 qwen3-1.7b vs H200 qwen3-8b",
    "startup": {
        "base_s": 147.2,
        "runs": 2,
        "s_per_billion_params": 8.09,
        "source": "bench/cost_constants.py STARTUP_SOURCES",
        "spread_s": {
            "1.72B": [
                161.1,
                161.1
            ],
            "8.19B": [
                213.5,
                213.5
            ]
        }
    },
    "sync": {
        "ipc": {
            "note": "",
            "s_per_gb": 0.01802,
            "source": "bench/results/gpu_grpo_1gpu_h200_2026-11-23.json#grpo_1gpu_turns (3.44 GB)"
        },
        "push": {
            "note": "",
            "s_per_gb": 0.01553,
            "source": "bench/results/gpu_grpo_h200x4_2026-11-22.json#grpo_3gpu (3.44 GB)"
        },
        "push_groups": {
            "note": "",
            "s_per_gb": 0.06472,
            "source": "bench/results/gpu_h200x2_2026-11-27g/side_by_side_groups.json#grpo_2gpu_off_policy (3.44 GB)"
        },
        "store": {
            "note": "measured 2026-11-21, when the store took one key a parameter; in a run not measured since it streams a block at a time; alone (bench/weight_push.py, qwen3-1.7b, two H200s, gpu_h200x2_2026-11-27d) it took 3.11 s a GB end to end",
            "s_per_gb": 3.91994,
            "source": "bench/results/gpu_grpo_h100.json#grpo (3.44 GB)"
        }
    }
}
