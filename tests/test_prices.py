"""Prices from SkyPilot's catalog and a run's predicted wall time and cost.

The offers table plans read (recipes/price_catalog/offers.json) must be what SkyPilot's
catalog module answers from the committed snapshot; the live path is the same module reading
catalog files where SkyPilot keeps them (here fixture files under SKY_RUNTIME_DIR)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.prices import live_offers, snapshot_offers
from recipes import load_recipe, plan
from recipes.prices import OFFERS_FILE, SNAPSHOT_DATE, SNAPSHOT_DIR, price_book
from recipes.run_cost import process_start_s, run_estimate


def test_committed_offers_are_what_sky_catalog_reads_from_the_snapshot():
    committed = json.loads(OFFERS_FILE.read_text())
    assert snapshot_offers() == committed
    assert committed["date"] == SNAPSHOT_DATE
    assert "snapshot of SkyPilot's catalog" in committed["source"]
    # every cloud of the snapshot sells some of forgesky's GPU types
    snapshot_clouds = sorted(p.name for p in (SNAPSHOT_DIR / "v8").iterdir() if p.is_dir())
    assert sorted({o["cloud"] for o in committed["offers"]}) == snapshot_clouds
    assert {"aws", "gcp", "lambda", "nebius", "oci", "runpod"} <= set(snapshot_clouds)


def test_gcp_nodes_are_priced_with_their_gpus():
    """GCP's catalog prices an A3 host and its H100s in rows apart: the offer is their sum
    in one region, the way SkyPilot prices the node, with the 8 GPUs a3-highgpu-8g carries."""
    book = price_book()
    a3 = next(o for o in book.offers if o.instance_type == "a3-highgpu-8g")
    assert (a3.cloud, a3.accelerator, a3.count) == ("gcp", "H100", 8)
    rows = (SNAPSHOT_DIR / "v8" / "gcp" / "vms.csv").read_text().splitlines()
    host = next(
        r for r in rows if r.startswith("a3-highgpu-8g,") and f",{a3.on_demand_region}," in r
    )
    gpus = next(r for r in rows if r.startswith(",,,H100,8,") and f",{a3.on_demand_region}," in r)
    host_price, gpu_price = float(host.split(",")[-2]), float(gpus.split(",")[-2])
    assert a3.on_demand == pytest.approx(host_price + gpu_price)
    assert a3.on_demand > 2 * host_price  # the GPUs are most of it
    # the counts a node of each type comes in, over the clouds
    assert book.counts("H100") == (1, 2, 4, 8)
    assert 8 in book.counts("H200") and 8 in book.counts("B200")


AWS_HEADER = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,"
    "Region,AvailabilityZone,Arch"
)
LAMBDA_HEADER = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice"
)
GCP_HEADER = (
    "InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,"
    "AvailabilityZone,Price,SpotPrice"
)


def _fixture_catalog(root: Path) -> None:
    aws = root / ".sky" / "catalogs" / "v8" / "aws"
    aws.mkdir(parents=True)
    info = "\"{'Gpus': [{'Name': 'H100', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}\""
    (aws / "vms.csv").write_text(
        "\n".join(
            [
                AWS_HEADER,
                f"p5.48xlarge,H100,8.0,192.0,2048.0,{info},40.0,12.5,us-east-1,use1-az1,x86_64",
                f"p5.48xlarge,H100,8.0,192.0,2048.0,{info},44.0,9.5,eu-north-1,eun1-az1,x86_64",
            ]
        )
        + "\n"
    )
    lam = root / ".sky" / "catalogs" / "v8" / "lambda"
    lam.mkdir(parents=True)
    info = "\"{'Gpus': [{'Name': 'H200', 'Manufacturer': 'NVIDIA', 'Count': 2.0, 'MemoryInfo': {'SizeInMiB': 144384}}], 'TotalGpuMemoryInMiB': 144384}\""
    (lam / "vms.csv").write_text(
        f"{LAMBDA_HEADER}\ngpu_2x_h200,H200,2.0,52.0,450.0,7.5,us-south-1,{info},\n"
    )
    # GCP: the host VM and its GPUs in rows apart; us-east4 has the cheaper host, us-central1
    # the cheaper node
    gcp = root / ".sky" / "catalogs" / "v8" / "gcp"
    gcp.mkdir(parents=True)
    gpu_info = "{'Gpus': [{'MemoryInfo': {'SizeInMiB': 81920}}]}"
    (gcp / "vms.csv").write_text(
        "\n".join(
            [
                GCP_HEADER,
                "a3-highgpu-8g,208.0,1872.0,,,,us-central1,us-central1-a,9.5,2.9",
                "a3-highgpu-8g,208.0,1872.0,,,,us-east4,us-east4-a,9.0,2.2",
                f",,,H100,8,{gpu_info},us-central1,us-central1-a,33.5,24.0",
                f",,,H100,8,{gpu_info},us-east4,us-east4-a,78.0,17.5",
            ]
        )
        + "\n"
    )


def test_live_catalog_files_are_read_by_sky_catalog(tmp_path):
    _fixture_catalog(tmp_path)
    got = live_offers(tmp_path, clouds=("aws", "lambda", "gcp"))
    assert got["source"] == "SkyPilot's catalog (aws, lambda, gcp)"
    by_type = {o["instance_type"]: o for o in got["offers"]}
    p5 = by_type["p5.48xlarge"]
    # on demand cheapest in us-east-1, spot in eu-north-1: each its own region
    assert (p5["on_demand"], p5["on_demand_region"]) == (40.0, "us-east-1")
    assert (p5["spot"], p5["spot_region"]) == (9.5, "eu-north-1")
    assert (p5["accelerator"], p5["count"]) == ("H100", 8)
    h200 = by_type["gpu_2x_h200"]
    assert (h200["on_demand"], h200["spot"], h200["count"]) == (7.5, None, 2)
    # GCP's node: host + GPUs of one region (9.5 + 33.5 on demand; 2.2 + 17.5 spot)
    a3 = by_type["a3-highgpu-8g"]
    assert (a3["accelerator"], a3["count"]) == ("H100", 8)
    assert (a3["on_demand"], a3["on_demand_region"]) == (43.0, "us-central1")
    assert (a3["spot"], a3["spot_region"]) == (19.7, "us-east4")


def test_live_catalog_unreadable_everywhere_is_one_line(tmp_path):
    with pytest.raises(RuntimeError, match="could not be read for any cloud"):
        live_offers(tmp_path, clouds=("aws",))


def test_run_estimate_adds_up_and_prices_the_cheapest_node():
    recipe = load_recipe("qwen3-8b")
    p = plan(recipe, 8)
    run = run_estimate(recipe, p)
    assert run is not None
    parts = recipe.grpo.steps * p.predicted_step_s + run.startup_s + run.eval_s + run.checkpoint_s
    parts += run.finish_s  # the last checkpoint's write and the export
    assert math.isclose(run.wall_s, parts)
    # provisioning and set-up, the download, and the processes' start the committed runs measured
    assert run.startup_s > run.provision_s + process_start_s(recipe.arch.params)
    assert process_start_s(recipe.arch.params) > process_start_s(
        load_recipe("qwen3-1.7b").arch.params
    )
    assert run.evals == 1 + recipe.grpo.steps // recipe.eval.every  # at start, every 50, the last
    book = price_book()
    cheapest = min(
        o.on_demand
        for o in book.offers
        if o.accelerator == "H100" and o.count == 8 and o.on_demand is not None
    )
    assert run.hourly(spot=False) == cheapest
    assert math.isclose(run.total(spot=False), cheapest * run.wall_s / 3600)
    assert run.total(spot=True) < run.total(spot=False)


def test_run_estimate_counts_every_node():
    recipe = load_recipe("qwen3-32b")
    p = plan(recipe, 16)
    run = run_estimate(recipe, p)
    assert run.nodes == 2
    assert run.hourly(spot=False) == 2 * run.on_demand.on_demand


def test_cpu_plan_has_no_run_estimate():
    recipe = load_recipe("tiny")
    assert run_estimate(recipe, plan(recipe, 0)) is None


def test_plan_shows_run_time_and_price(capsys):
    assert main(["plan", "qwen3-8b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    run_line = next(line for line in out.splitlines() if line.startswith("run: "))
    assert "500 steps x " in run_line and "predicted" in run_line
    price = next(line for line in out.splitlines() if line.startswith("price of 1 node x 8 H100"))
    assert "on demand $" in price and "spot $" in price and "for the run" in price
    assert (
        f"snapshot of SkyPilot's catalog (aws, gcp, lambda, nebius, oci, runpod), {SNAPSHOT_DATE}"
        in out
    )


def test_plan_json_carries_the_run(capsys):
    assert main(["plan", "qwen3-8b", "--gpus", "8", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["steps"] == 500
    assert run["on_demand_total"] == pytest.approx(
        run["on_demand_per_hour"] * run["wall_s"] / 3600, rel=1e-2
    )
    assert run["price_source"].endswith(SNAPSHOT_DATE)


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgesky: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_idle_nodes_are_refused_with_the_count_that_gives_the_same_plan(capsys):
    code = main(["plan", "qwen3-1.7b", "--gpus", "64"])
    _, err = capsys.readouterr()
    assert_one_line_error(
        code, err, "--gpus 64 leaves 39 GPUs without work (4 whole nodes)", "--gpus 32 gives"
    )
    # what 39 idle H100s cost an hour: the cheapest 8-GPU node's price for each GPU
    eight = price_book().cheapest("H100", 8, spot=False)
    assert f"${eight.on_demand / 8 * 39:,.0f}/h on demand" in err
    same = plan(load_recipe("qwen3-1.7b"), 32)
    assert same.placements == plan(load_recipe("qwen3-1.7b"), 64).placements


def test_idle_refused_by_launch_and_validate_too(capsys, tmp_path):
    code = main(["launch", "qwen3-1.7b", "--gpus", "4096", "--dryrun"])
    assert_one_line_error(code, capsys.readouterr().err, "--gpus 32 gives the same plan")
    recipe = tmp_path / "r.yaml"
    assert main(["cp", "qwen3-1.7b", str(recipe)]) == 0
    capsys.readouterr()
    code = main(["validate", str(recipe), "--gpus", "64"])
    assert_one_line_error(code, capsys.readouterr().err, "leaves")


def test_allow_idle_keeps_them(capsys):
    assert main(["plan", "qwen3-1.7b", "--gpus", "64", "--allow-idle"]) == 0
    assert "64 x H100 (8 nodes" in capsys.readouterr().out


def test_a_count_that_fills_its_gpus_is_not_refused(capsys):
    assert main(["plan", "qwen3-8b", "--gpus", "16"]) == 0


def test_gpu_type_plans_for_that_type_only(capsys):
    assert main(["plan", "qwen3-8b", "--gpu-type", "h200", "--gpus", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["accelerator"] == "H200" and d["total_gpus"] == 2


def test_gpu_type_reaches_the_task(capsys):
    assert main(["render", "qwen3-8b", "--gpu-type", "A100-80GB", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    resources = out.split("\nresources:", 1)[1].split("\n\n")[0]
    assert "A100-80GB: 8" in resources and "H200" not in resources


def test_unknown_gpu_type_names_the_close_ones(capsys):
    code = main(["plan", "qwen3-8b", "--gpu-type", "a100"])
    assert_one_line_error(code, capsys.readouterr().err, "--gpu-type 'a100'", "A100-80GB?")


def test_too_few_gpus_names_the_types_they_fit_on(capsys):
    code = main(["plan", "qwen3-8b", "--gpus", "2"])
    assert_one_line_error(code, capsys.readouterr().err, "2 GPUs fit on H200 or B200")


def test_cheapest_ranks_types_counts_and_spot_by_total(capsys):
    from recipes.cheapest import options

    found = options(load_recipe("qwen3-8b"))
    totals = [o.total for o in found]
    assert totals == sorted(totals)
    kinds = {(o.accelerator, o.spot) for o in found}
    assert {("H100", False), ("H100", True), ("H200", True), ("A100-80GB", True)} <= kinds
    # H200 speeds are measured, the others scaled from them with a wider error
    assert {o.accelerator for o in found if o.measured} == {"H200"}
    assert all(o.error > 0.15 for o in found if not o.measured)
    for o in found:  # each priced as its own plan's run
        assert o.total == pytest.approx(o.offer.price(o.spot) * o.nodes * o.run.wall_s / 3600)
    assert main(["plan", "qwen3-8b", "--cheapest"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == [
        "GPUS",
        "TYPE",
        "NODES",
        "OFFER",
        "$/H",
        "WALL",
        "TOTAL",
        "SPEEDS",
    ]
    assert "fastest: " in out and "measured ±15%" in out and "scaled ±35%" in out


def test_cheapest_within_a_deadline_and_budget(capsys):
    assert (
        main(["plan", "qwen3-8b", "--cheapest", "--deadline", "1.6h", "--budget", "$30", "--json"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)["options"]
    assert got and all(o["wall_s"] <= 1.6 * 3600 and o["total"] <= 30 for o in got)


def test_cheapest_of_one_type(capsys):
    assert main(["plan", "qwen3-8b", "--cheapest", "--gpu-type", "H200", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["options"]
    assert {o["accelerator"] for o in got} == {"H200"}


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--budget", "1"], ["nothing meets --budget $1.00", "the cheapest is", "the fastest"]),
        (["--deadline", "10m"], ["nothing meets --deadline 10 min", "the fastest"]),
        (["--budget", "-3"], ["--budget '-3': a positive amount"]),
        (["--budget", "lots"], ["--budget 'lots'"]),
        (["--deadline", "8x"], ["--deadline '8x': a positive duration"]),
        (["--deadline", "0h"], ["--deadline '0h'"]),
        (["--gpus", "8", "--gpu-type", "H100"], ["both --gpus and --gpu-type fixed"]),
        (["--gpu-type", "H1OO"], ["--gpu-type 'H1OO'", "H100"]),
    ],
)
def test_cheapest_bad_input_is_one_line(capsys, argv, fragments):
    code = main(["plan", "qwen3-8b", "--cheapest", *argv])
    assert_one_line_error(code, capsys.readouterr().err, *fragments)


def test_budget_without_cheapest_is_refused(capsys):
    code = main(["plan", "qwen3-8b", "--budget", "200"])
    assert_one_line_error(code, capsys.readouterr().err, "go with --cheapest")


def test_prices_command_lists_the_table_and_its_source(capsys):
    assert main(["prices"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["TYPE", "GPUS", "CLOUD", "INSTANCE"]
    assert "p5.48xlarge" in out and f"{SNAPSHOT_DATE} (cheapest region" in out


def test_prices_snapshot_without_refresh_is_refused(capsys):
    code = main(["prices", "--snapshot"])
    assert_one_line_error(code, capsys.readouterr().err, "--snapshot goes with --refresh")


def test_run_time_check_reports_the_error_of_each_run(tmp_path, capsys):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import run_time_check

    run = tmp_path / "grpo-qwen3-8b"
    run.mkdir()
    summary = {"steps": 20, "measured_wall_s": 1150.0, "predicted": {"wall_s_on_the_nodes": 1000.0}}
    (run / "summary.json").write_text(json.dumps(summary))
    cpu = tmp_path / "tiny"
    cpu.mkdir()
    (cpu / "summary.json").write_text(
        json.dumps({"steps": 3, "measured_wall_s": 30.0, "predicted": None})
    )
    out = tmp_path / "check.json"
    assert run_time_check.main([str(run), str(cpu), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert rows[0]["error"] == 0.15 and rows[0]["within_target"]
    assert rows[1]["error"] is None
    printed = capsys.readouterr().out
    assert "error +15.0%" in printed and "largest error 15.0% over 1 runs" in printed
    # what --out wrote reads back as a source
    assert run_time_check.main([str(out)]) == 0
    assert run_time_check.main([str(tmp_path / "missing")]) == 2
    # a GPU bench's JSON: each section's run_summary
    bench = tmp_path / "gpu_grpo.json"
    bench.write_text(json.dumps({"device": {"name": "H200"}, "grpo": {"run_summary": summary}}))
    assert run_time_check.summaries(bench) == [(f"{bench}#grpo", summary)]


def test_launch_carries_the_plans_price_to_the_nodes(capsys):
    assert main(["render", "qwen3-8b", "--gpus", "8", "--spot"]) == 0
    out = capsys.readouterr().out
    spot = price_book().cheapest("H100", 8, spot=True)
    assert f"--set resources.usd_per_node_hour={spot.spot} " in out
    assert f"'resources.price_source={spot.cloud} {spot.spot_region} " in out
    # on the cloud --infra names, that cloud's price
    assert main(["render", "qwen3-8b", "--gpus", "8", "--infra", "lambda"]) == 0
    on_lambda = price_book().cheapest("H100", 8, spot=False, cloud="lambda")
    assert f"resources.usd_per_node_hour={on_lambda.on_demand} " in capsys.readouterr().out
    # a recipe that sets its own price keeps it
    argv = ["render", "qwen3-8b", "--gpus", "8", "--set", "resources.usd_per_node_hour=1.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resources.usd_per_node_hour=1.5" in out and "price_source" not in out


def test_the_run_time_check_also_prices_each_step_at_the_runs_own_lengths(tmp_path, capsys):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import run_time_check

    from runtime.control.metrics import MetricsLogger
    from runtime.control.run import _at_run_lengths

    # the runtime's side: the cost model at the metrics' mean lengths, on the run's own plan
    recipe = load_recipe("qwen3-1.7b")
    p = plan(recipe, 1, accelerator="H200")
    with open(os.devnull, "w") as quiet:
        metrics = MetricsLogger(tmp_path / "run", stream=quiet)
        for step in (1, 2):
            metrics.log(step, {"prompt/len_mean": 200.0, "response/len_mean": 500.0 + step})
        metrics.close()
    at = _at_run_lengths(metrics, recipe, p)
    assert at["prompt_tokens"] == 200.0 and at["response_tokens"] == 501.5
    assert 0 < at["step_s"] < p.predicted_step_s  # shorter than the recipe's maxima
    # the check's side: a bench section's own step at the run's lengths stands in where the
    # runtime did not record one
    summary = {
        "steps": 20,
        "measured_wall_s": 600.0,
        "predicted": {"steps": 20, "step_s": 30.0, "wall_s_on_the_nodes": 800.0},
    }
    bench = tmp_path / "gpu_grpo.json"
    bench.write_text(json.dumps({"grpo": {"run_summary": summary, "predicted_step_s": 25.0}}))
    assert run_time_check.main([str(bench), "--out", str(tmp_path / "out.json")]) == 0
    row = json.loads((tmp_path / "out.json").read_text())["runs"][0]
    assert row["error"] == -0.25 and not row["within_target"]
    assert row["predicted_at_run_lengths_s"] == 700.0 and row["error_at_run_lengths"] == -0.143
    assert "at the run's lengths 700 s, error -14.3%" in capsys.readouterr().out


def test_a_plan_prices_steps_at_the_means_a_recipe_states_and_a_run_names_its_own(tmp_path):
    from recipes import apply_overrides
    from recipes.errors import UserError
    from runtime.control.metrics import MetricsLogger
    from runtime.control.run import summary_line

    recipe = load_recipe("qwen3-1.7b")
    stated = apply_overrides(
        recipe, ["dataset.prompt_tokens_mean=207", "dataset.response_tokens_mean=512"]
    )
    at_max, at_means = plan(recipe, 1, accelerator="H200"), plan(stated, 1, accelerator="H200")
    assert at_means.predicted_step_s < at_max.predicted_step_s
    words = "207-token prompts (dataset.prompt_tokens_mean) and 512-token completions "
    assert words + "(dataset.response_tokens_mean)" in at_means.describe()
    assert run_estimate(stated, at_means).step_s == round(at_means.predicted_step_s, 3)
    with pytest.raises(UserError, match=r"dataset.response_tokens_mean: 2000 exceeds grpo.max_"):
        apply_overrides(recipe, ["dataset.response_tokens_mean=2000"])
    # the run's summary names the means it had, where they are 10 % or more off the plan's
    with open(os.devnull, "w") as quiet:
        metrics = MetricsLogger(tmp_path / "run", stream=quiet)
        for step in (1, 2):
            metrics.log(step, {"prompt/len_mean": 207.0, "response/len_mean": 512.0})
        line = summary_line(metrics, recipe, at_max, 2, 256)
        assert "--set dataset.prompt_tokens_mean=207 --set dataset.response_tokens_mean=512" in line
        assert "for the next plan" not in summary_line(metrics, stated, at_means, 2, 256)
        metrics.close()
