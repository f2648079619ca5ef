"""A run placed on a Ray cluster, before anything starts: what each service asks (its CPUs, custom resources and
the GPUs its processes need), whether that fits the cluster's nodes, and the one-line errors of a run that
cannot be placed (no run directory made, no Ray process started). The cluster itself runs in
tests/test_e2e_ray.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dart.cli.cluster.ray_cluster import Ask, Node, check_fits, import_ray
from dart.cli.cluster.ray_launch import asks
from dart.cli.main import app
from dart.cli.stack.config import load_run_config
from dart.cli.stack.placement import demand
from dart.protocol.errors import ConfigError
from dart.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
SMOKE_RAY = ROOT / "examples" / "smoke-ray.yaml"


def nodes(*gpus: int, extra: dict[str, float] | None = None) -> list[Node]:
    return [
        Node(f"id-{i}", "127.0.0.1", f"n{i}", {"CPU": 4.0, "GPU": float(g), **(extra or {})})
        for i, g in enumerate(gpus)
    ]


def test_each_service_asks_for_its_resources_and_the_gpus_of_its_processes() -> None:
    config = load_run_config(SMOKE_RAY)
    by_service = {a.service: a for a in asks(config, has_gpus=True, head="head-id")}

    assert by_service["rollout"].bundles == [{"CPU": 1.0, "GPU": 2.0}]
    assert by_service["rollout"].on_node == "head-id"
    assert by_service["env"].on_node == by_service["data"].on_node == "head-id"
    assert by_service["train"].bundles == [{"CPU": 1.0, "GPU": 1.0, "trainer_slot": 1.0}] * 2
    assert by_service["train"].on_node is None and by_service["train"].strategy == "SPREAD"
    # Every trainer node is placed (dart run on one machine places only its own node's ranks).
    wanted = demand(config, has_gpus=True, every_node=True, gpus_per_rank=1, gpus_per_engine=1)
    assert [(p, node, n) for _, p, node, n in wanted] == [
        ("trainer", 0, 1),
        ("trainer", 1, 1),
        ("hf-engine-0", 0, 1),
        ("hf-engine-1", 0, 1),
    ]
    assert [(p, node) for _, p, node, _ in demand(config, has_gpus=True, gpus_per_rank=1)] == [("trainer", 0)]


def test_what_fits_passes_and_what_does_not_is_named() -> None:
    trainer = Ask("train", [{"CPU": 1.0, "GPU": 1.0}] * 2, "STRICT_SPREAD", processes=["trainer 1", "trainer 1"])
    rollout = Ask("rollout", [{"CPU": 1.0, "GPU": 2.0}], processes=["hf-engine-0 1", "hf-engine-1 1"])
    check_fits([trainer, rollout], nodes(2, 2), "run.yaml", "the cluster")

    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* but the cluster has 3"):
        check_fits([trainer, rollout], nodes(2, 1), "run.yaml", "the cluster")
    with pytest.raises(ConfigError, match="asks for 'desktop', which no node of the cluster offers"):
        check_fits([Ask("env", [{"CPU": 1.0, "desktop": 1.0}])], nodes(0, 0), "run.yaml", "the cluster")
    with pytest.raises(ConfigError, match=r"asks for \{CPU: 1, GPU: 3\}, which no node of the cluster has"):
        check_fits([Ask("rollout", [{"CPU": 1.0, "GPU": 3.0}])], nodes(2, 2), "run.yaml", "the cluster")
    with pytest.raises(ConfigError, match="on the node dart run runs on"):
        check_fits([Ask("rollout", [{"CPU": 1.0, "GPU": 2.0}], on_node="id-0")], nodes(0, 2), "r.yaml", "the cluster")
    with pytest.raises(ConfigError, match="STRICT_SPREAD: the trainer's 3 nodes need as many"):
        check_fits([Ask("train", [{"CPU": 1.0}] * 3, "STRICT_SPREAD")], nodes(0, 0), "run.yaml", "the cluster")


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without the extra has
    with pytest.raises(ConfigError, match=r"pip install 'dart-cli\[ray\]'"):
        import_ray("run.yaml")


def dart(*args: str, runs: Path) -> tuple[int, str]:
    """The dart command in this process (the checks come before anything starts): exit code and stderr."""
    result = CliRunner().invoke(app, list(args), env={"DART_RUN__RUNS_ROOT": str(runs)})
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray", "127.0.0.1:{port}"], "no Ray cluster answers there"),
        (
            ["cluster.gpus.per_engine=3"],
            "needs 8 GPUs (trainer 1, trainer 1, hf-engine-0 3, hf-engine-1 3) but the local cluster has 6",
        ),
        (
            ["cluster.services.env.resources={desktop: 1}"],
            "asks for 'desktop', which no node of the local cluster offers",
        ),
        (["cluster.kind=local"], "'train.backend.rdzv_endpoint': is unset, but nnodes is 2"),
    ],
)
def test_a_run_that_cannot_be_placed_is_refused_in_one_line_before_anything_starts(
    args: list[str], message: str, tmp_path: Path
) -> None:
    args = [a.replace("{port}", str(free_port())) for a in args]
    code, stderr = dart("run", str(SMOKE_RAY), *args, runs=tmp_path)

    assert code == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no run directory (and the local cluster is checked before it starts)


def test_doctor_names_an_address_where_no_cluster_answers(tmp_path: Path) -> None:
    code, stderr = dart("doctor", "--ray", f"127.0.0.1:{free_port()}", runs=tmp_path)
    assert code == 2
    assert stderr.startswith("error: ") and "no Ray cluster answers there" in stderr
