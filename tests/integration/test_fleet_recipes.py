"""The fleet actuation recipes (docs/recipes/) run by the real command actuator, against fake `kubectl`
and `helm` binaries that record every call and answer like the real ones would. No Kubernetes cluster
is used: what is tested is the rendering — the commands, the JSON patch, the values file — and the
recipe's control flow (rollout status, undo on a failed rollout, nothing done when in force already).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from policies.spec_config import SpecConfig
from tuner.actuators import ApplyStatus, CommandActuator

RECIPES = Path(__file__).parents[2] / "docs" / "recipes"
EAGLE = SpecConfig("eagle3", "/models/eagle3-llama", 4, extra={"draft_tensor_parallel_size": 1})
EAGLE_ARG = json.dumps(EAGLE.to_vllm(), sort_keys=True, separators=(",", ":"))
OLD_ARG = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}'

# what `kubectl get` and `helm get values` answer, and what each rollout status exits with (one per call)
FAKE = """\
import json, os, sys
from pathlib import Path
root = Path(os.environ["FAKE_ORCHESTRATOR_DIR"])
argv = sys.argv[1:]
record = {"tool": Path(sys.argv[0]).name, "argv": argv}
if "-f" in argv:
    record["values"] = json.loads(Path(argv[argv.index("-f") + 1]).read_text())
with open(root / "calls.jsonl", "a") as log:
    log.write(json.dumps(record) + "\\n")
if "get" in argv and "deployment" in argv:
    print((root / "deployment.json").read_text())
elif argv[:2] == ["get", "values"]:
    print((root / "values.json").read_text())
elif "rollout" in argv and "status" in argv:
    codes = json.loads((root / "rollout_rc.json").read_text())
    rc = codes.pop(0) if codes else 0
    (root / "rollout_rc.json").write_text(json.dumps(codes))
    if rc:
        sys.stderr.write("error: deployment exceeded its progress deadline\\n")
    sys.exit(rc)
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "orchestrator"
    root.mkdir()
    for tool in ("kubectl", "helm"):
        path = root / tool
        path.write_text(f"#!{sys.executable}\n{FAKE}")
        path.chmod(0o755)
    (root / "rollout_rc.json").write_text("[]")
    monkeypatch.setenv("FAKE_ORCHESTRATOR_DIR", str(root))
    return root


def calls(root: Path) -> list[dict[str, Any]]:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def deployment(command: list[str], args: list[str] | None = None) -> dict[str, Any]:
    """A Deployment as the vLLM production-stack chart renders it: vLLM's flags in `command`."""
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": command}
    if args is not None:
        container["args"] = args
    sidecar = {"name": "spectuner", "image": "spectuner:latest", "args": ["run"]}
    return {"kind": "Deployment", "spec": {"template": {"spec": {"containers": [sidecar, container]}}}}


SERVE = ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0", "--port", "8000"]


def kubectl_actuator(root: Path, *extra: str) -> CommandActuator:
    argv = [
        sys.executable,
        str(RECIPES / "kubectl_patch_deployment.py"),
        "--deployment",
        "vllm-llama",
        "--namespace",
        "llm",
        "--kubectl",
        str(root / "kubectl"),
        "--rollout-timeout-s",
        "900",
        *extra,
    ]
    return CommandActuator(argv, timeout_s=60)


def test_kubectl_recipe_replaces_the_flag_with_a_guarded_json_patch_and_waits(fake: Path) -> None:
    before = [*SERVE, "--speculative-config", OLD_ARG, "--max-num-seqs", "64"]
    (fake / "deployment.json").write_text(json.dumps(deployment(before)))
    result = kubectl_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.APPLIED, (result.message, result.detail)
    get, patch, rollout = calls(fake)
    assert get["argv"] == ["--namespace", "llm", "get", "deployment", "vllm-llama", "-o", "json"]
    assert patch["argv"][:6] == ["--namespace", "llm", "patch", "deployment", "vllm-llama", "--type=json"]
    ops = json.loads(patch["argv"][patch["argv"].index("-p") + 1])
    path = "/spec/template/spec/containers/1/command"  # the vllm container, not the sidecar
    after = [*SERVE, "--speculative-config", EAGLE_ARG, "--max-num-seqs", "64"]  # same place, rest kept
    assert ops == [{"op": "test", "path": path, "value": before}, {"op": "replace", "path": path, "value": after}]
    assert SpecConfig.from_vllm(json.loads(after[after.index("--speculative-config") + 1])) == EAGLE
    assert rollout["argv"] == ["--namespace", "llm", "rollout", "status", "deployment/vllm-llama", "--timeout=900s"]
    assert "rolled out with --speculative-config" in result.detail


def test_kubectl_recipe_adds_to_args_and_handles_the_equals_form_and_off(fake: Path) -> None:
    (fake / "deployment.json").write_text(json.dumps(deployment(["vllm"], args=["serve", "m", "--port", "8000"])))
    assert kubectl_actuator(fake, "--context", "prod").apply(EAGLE.to_vllm()).status is ApplyStatus.APPLIED
    ops = json.loads(calls(fake)[1]["argv"][-1])
    assert calls(fake)[1]["argv"][:4] == ["--namespace", "llm", "--context", "prod"]
    assert ops[1] == {
        "op": "replace",
        "path": "/spec/template/spec/containers/1/args",
        "value": ["serve", "m", "--port", "8000", "--speculative-config", EAGLE_ARG],
    }
    (fake / "calls.jsonl").unlink()
    (fake / "deployment.json").write_text(
        json.dumps(deployment(["vllm"], args=["serve", "m", f"--speculative-config={OLD_ARG}", "--port", "8000"]))
    )
    assert kubectl_actuator(fake).apply({"method": "off"}).status is ApplyStatus.APPLIED
    assert json.loads(calls(fake)[1]["argv"][-1])[1]["value"] == ["serve", "m", "--port", "8000"]


def test_kubectl_recipe_does_nothing_when_the_config_is_in_force(fake: Path) -> None:
    (fake / "deployment.json").write_text(json.dumps(deployment([*SERVE, "--speculative-config", EAGLE_ARG])))
    result = kubectl_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.APPLIED and "nothing patched" in result.detail
    assert [c["argv"][2] for c in calls(fake)] == ["get"]


def test_kubectl_recipe_undoes_a_failed_rollout_and_reports_failure(fake: Path) -> None:
    (fake / "deployment.json").write_text(json.dumps(deployment([*SERVE, "--speculative-config", OLD_ARG])))
    (fake / "rollout_rc.json").write_text("[1, 0]")  # the new pods never get ready; the undo rolls out
    act = kubectl_actuator(fake)
    act.current = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    result = act.apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.FAILED and "refused" in result.message
    assert "undone to its previous config" in result.message and "progress deadline" in result.message
    assert [c["argv"][2:4] for c in calls(fake)] == [
        ["get", "deployment"],
        ["patch", "deployment"],
        ["rollout", "status"],
        ["rollout", "undo"],
        ["rollout", "status"],
    ]
    assert act.current["method"] == "ngram"  # the actuator keeps the old config as in force


def test_kubectl_recipe_names_a_missing_container(fake: Path) -> None:
    doc = deployment(SERVE)
    doc["spec"]["template"]["spec"]["containers"][1]["name"] = "engine"
    (fake / "deployment.json").write_text(json.dumps(doc))
    result = kubectl_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.FAILED and "no container 'vllm'" in result.message
    assert "['spectuner', 'engine']" in result.message


VALUES = {
    "servingEngineSpec": {
        "runtimeClassName": "",
        "modelSpec": [
            {
                "name": "llama3",
                "repository": "vllm/vllm-openai",
                "tag": "latest",
                "modelURL": "meta-llama/Llama-3.1-8B-Instruct",
                "replicaCount": 4,
                "vllmConfig": {"maxModelLen": 8192, "extraArgs": ["--disable-log-requests"]},
            },
            {"name": "mistral", "modelURL": "mistralai/Mistral-7B-Instruct-v0.3", "replicaCount": 2},
        ],
    },
    "routerSpec": {"routingLogic": "roundrobin"},
}


def helm_actuator(root: Path) -> CommandActuator:
    argv = [
        sys.executable,
        str(RECIPES / "helm_production_stack.py"),
        "--release",
        "vllm",
        "--chart",
        "vllm/vllm-stack",
        "--chart-version",
        "0.1.7",
        "--namespace",
        "llm",
        "--model-spec",
        "llama3",
        "--helm",
        str(root / "helm"),
        "--kubectl",
        str(root / "kubectl"),
    ]
    return CommandActuator(argv, timeout_s=60)


def test_helm_recipe_changes_only_that_model_specs_extra_args_and_waits(fake: Path) -> None:
    (fake / "values.json").write_text(json.dumps(VALUES))
    result = helm_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.APPLIED, (result.message, result.detail)
    get, upgrade, rollout = calls(fake)
    assert get["tool"] == "helm" and get["argv"] == ["get", "values", "vllm", "--namespace", "llm", "-o", "json"]
    assert upgrade["argv"][:7] == ["upgrade", "vllm", "vllm/vllm-stack", "--namespace", "llm", "--version", "0.1.7"]
    expected = json.loads(json.dumps(VALUES))
    expected["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArgs"] = [
        "--disable-log-requests",
        "--speculative-config",
        EAGLE_ARG,
    ]
    assert upgrade["values"] == expected  # every other value exactly as the release had it
    assert rollout["tool"] == "kubectl"
    assert rollout["argv"] == [
        "--namespace",
        "llm",
        "rollout",
        "status",
        "deployment/vllm-llama3-deployment-vllm",
        "--timeout=600s",
    ]
    assert not Path(upgrade["argv"][upgrade["argv"].index("-f") + 1]).exists()  # the values file is removed


def test_helm_recipe_adds_vllm_config_where_there_is_none_and_rolls_back_a_failure(fake: Path) -> None:
    values = json.loads(json.dumps(VALUES))
    del values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]
    (fake / "values.json").write_text(json.dumps(values))
    (fake / "rollout_rc.json").write_text("[1, 0]")
    result = helm_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.FAILED and "rolled back to its previous revision" in result.message
    upgrade = calls(fake)[1]
    assert upgrade["values"]["servingEngineSpec"]["modelSpec"][0]["vllmConfig"] == {
        "extraArgs": ["--speculative-config", EAGLE_ARG]
    }
    assert [(c["tool"], c["argv"][0]) for c in calls(fake)] == [
        ("helm", "get"),
        ("helm", "upgrade"),
        ("kubectl", "--namespace"),
        ("helm", "rollback"),
        ("kubectl", "--namespace"),
    ]
    assert calls(fake)[3]["argv"] == ["rollback", "vllm", "--namespace", "llm"]


def test_helm_recipe_refuses_an_unknown_model_spec(fake: Path) -> None:
    (fake / "values.json").write_text(json.dumps({"servingEngineSpec": {"modelSpec": [{"name": "other"}]}}))
    result = helm_actuator(fake).apply(EAGLE.to_vllm())
    assert result.status is ApplyStatus.FAILED and "no servingEngineSpec.modelSpec named 'llama3'" in result.message
    assert [c["argv"][0] for c in calls(fake)] == ["get"]  # nothing upgraded


def test_flag_rewriting_covers_every_spelling() -> None:
    sys.path.insert(0, str(RECIPES))
    try:
        from recipe_common import RecipeError, read_config, with_spec
    finally:
        sys.path.remove(str(RECIPES))
    argv = ["serve", "m", "--speculative_config", "A", "--port", "1", "--speculative-config=B"]
    assert with_spec(argv, "C") == ["serve", "m", "--speculative-config", "C", "--port", "1"]
    assert with_spec(argv, None) == ["serve", "m", "--port", "1"]
    assert with_spec(["serve"], "C") == ["serve", "--speculative-config", "C"]
    assert read_config('{"speculative_config": {}}') is None
    assert read_config('{"speculative_config": {"num_speculative_tokens": 2, "method": "ngram"}}') == (
        '{"method":"ngram","num_speculative_tokens":2}'
    )
    for bad in ("[1,", '{"config": {}}', '{"speculative_config": 3}'):
        with pytest.raises(RecipeError, match="stdin"):
            read_config(bad)
