"""The image and the compose deployments, checked statically and, for Redis, by running the compose file's
own Redis command: the Dockerfile runs as a non-root user, probes health with `kvfuse serve --health` and
takes kvfuse's arguments (ENTRYPOINT); in every compose file each service has a healthcheck, Redis has no
user without a password, the single-host file publishes no Redis port, every env var is a real setting,
every command a real CLI command; the CPU overrides drop the GPU. The images built and run for real, on a
Docker engine: tests/deploy/ (`make test-deploy`)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from kvfuse.cli import build_parser
from kvfuse.config import Settings

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.fleet.yml")
CPU_OVERRIDES = {"docker-compose.yml": "docker-compose.cpu.yml", "docker-compose.fleet.yml": "docker-compose.fleet.cpu.yml"}
KVFUSE_SERVICES = {"docker-compose.yml": ("kvfuse",), "docker-compose.fleet.yml": ("api", "worker")}
SECRETS_DIR = "/run/secrets/"
SERVE_HEALTH = ["CMD", "kvfuse", "serve", "--health", "--port", "8000"]


class _ComposeLoader(yaml.SafeLoader):
    """YAML with compose's `!reset` tag (an override's way to drop a key), read as a marker."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def load_compose(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=_ComposeLoader)  # noqa: S506 - a safe loader


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose("docker-compose.yml")


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def _is_setting(env_name: str) -> bool:
    from pydantic import BaseModel

    model: type[BaseModel] = Settings
    parts = env_name.removeprefix("KVFUSE_").lower().split("__")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(parts) - 1:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                return False
            model = field.annotation
    return True


def _instruction(dockerfile: str, name: str) -> str:
    """The last `NAME ...` instruction of the Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    found = re.findall(rf"^{name} (.+)$", joined, re.M)
    assert found, f"the Dockerfile has no {name}"
    return found[-1].strip()


def test_compose_services(compose: dict):
    assert set(compose["services"]) == {"redis", "kvfuse"}
    kv = compose["services"]["kvfuse"]
    assert kv["depends_on"]["redis"]["condition"] == "service_healthy"
    devices = kv["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert kv["environment"]["KVFUSE_REDIS_URL"].startswith("redis://redis:")
    assert any(v.endswith(":/data") for v in kv["volumes"])
    assert kv["environment"]["KVFUSE_DATA_DIR"] == "/data"
    start = kv["healthcheck"]["start_period"]
    assert int(re.fullmatch(r"(\d+)s", start).group(1)) >= 120, "model load needs a long start period"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_service_has_a_healthcheck_and_kvfuse_probes_health(name: str):
    services = load_compose(name)["services"]
    assert all("healthcheck" in svc for svc in services.values())
    for svc_name in KVFUSE_SERVICES[name]:
        check = services[svc_name]["healthcheck"]
        # health, not readiness: a short Redis outage turns /ready 503, and a restart would not mend it
        assert "/ready" not in " ".join(check["test"])
        if svc_name != "worker":
            assert check["test"] == SERVE_HEALTH
            assert services[svc_name]["command"][-2:] == ["--port", "8000"] or "8000" in services[svc_name]["command"]
        assert "start_interval" not in check  # Debian's docker.io (Engine 20.10) refuses it
        assert int(check["interval"].rstrip("s")) <= 5  # `up --wait` returns soon after ready


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_no_redis_without_a_password(name: str):
    c = load_compose(name)
    redis = c["services"]["redis"]
    script = " ".join(redis["command"])
    assert "user default off" in script and "--aclfile" in script and "nopass" not in script
    assert "redis_password" in redis["secrets"]
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])  # the healthcheck authenticates too
    for svc_name in KVFUSE_SERVICES[name]:
        env = c["services"][svc_name]["environment"]
        assert env["KVFUSE_REDIS__USERNAME"] == "kvfuse"
        assert env["KVFUSE_REDIS__PASSWORD_FILE"] == SECRETS_DIR + "redis_password"
        assert "redis_password" in c["services"][svc_name]["secrets"]
    for svc in c["services"].values():  # every secret used is declared, from an environment variable
        for secret in svc.get("secrets", []):
            assert c["secrets"][secret]["environment"].startswith("KVFUSE_")


def test_the_single_host_file_publishes_no_redis_port(compose: dict):
    assert "ports" not in compose["services"]["redis"]


def test_the_fleet_file_publishes_redis_on_loopback_unless_told(compose: dict):
    ports = load_compose("docker-compose.fleet.yml")["services"]["redis"]["ports"]
    assert ports == ["${KVFUSE_REDIS_PUBLISH:-127.0.0.1}:${KVFUSE_REDIS_PUBLISH_PORT:-6379}:6379"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_the_api_key_reaches_the_server_as_a_file(name: str):
    c = load_compose(name)
    api = c["services"][KVFUSE_SERVICES[name][0]]
    assert api["environment"]["KVFUSE_API_KEY_FILE"] == SECRETS_DIR + "api_key"
    assert c["secrets"]["api_key"]["environment"] == "KVFUSE_API_KEY"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_env_vars_are_real_settings(name: str):
    for service in load_compose(name)["services"].values():
        for env in (service.get("environment") or {}):
            if env.startswith("KVFUSE_"):
                assert _is_setting(env), f"{env} is not a kvfuse setting"


def test_the_image_runs_as_a_user_probes_health_and_takes_kvfuse_arguments(dockerfile: str):
    user = _instruction(dockerfile, "USER")
    assert user not in ("root", "0") and not user.startswith(("root:", "0:"))
    assert dockerfile.index("USER ") > dockerfile.index("kvfuse models prepare")  # models prepared as root
    health = _instruction(dockerfile, "HEALTHCHECK")
    assert health.endswith('CMD ["kvfuse", "serve", "--health"]') and "--start-period=" in health
    assert "--start-interval" not in health  # Engine 20.10's builder refuses it
    assert yaml.safe_load(_instruction(dockerfile, "ENTRYPOINT")) == ["kvfuse"]
    assert yaml.safe_load(_instruction(dockerfile, "CMD"))[0] == "serve"


def test_compose_and_dockerfile_commands_are_real_cli_commands(compose: dict, dockerfile: str):
    parser = build_parser()
    fleet = load_compose("docker-compose.fleet.yml")["services"]
    # The image's ENTRYPOINT is kvfuse: a compose command and the CMD are its arguments.
    health = yaml.safe_load(_instruction(dockerfile, "HEALTHCHECK").split(" CMD ", 1)[1])
    commands = [compose["services"]["kvfuse"]["command"], fleet["api"]["command"], fleet["worker"]["command"],
                fleet["worker"]["healthcheck"]["test"][2:], compose["services"]["kvfuse"]["healthcheck"]["test"][2:],
                fleet["api"]["healthcheck"]["test"][2:], health[1:], yaml.safe_load(_instruction(dockerfile, "CMD"))]
    for run in re.findall(r"&& kvfuse ([^\\\n&]+)", dockerfile):
        commands.append(shlex.split(run))
    assert len(commands) >= 6
    for argv in commands:
        args = parser.parse_args(argv)
        assert getattr(args, "func", None), f"kvfuse {argv} is not a runnable command"


def test_health_is_a_route_that_says_503_when_not_ok():
    from kvfuse.config import load_settings
    from kvfuse.service.api.app import create_app

    health = create_app(load_settings()).openapi()["paths"]["/health"]["get"]
    assert set(health["responses"]) >= {"200", "503"}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_the_cpu_overrides_drop_the_gpu_and_build_the_cpu_image(name: str):
    override = load_compose(CPU_OVERRIDES[name])["services"]
    gpu_services = [s for s, svc in load_compose(name)["services"].items() if "deploy" in svc]
    assert gpu_services and all(override[s]["deploy"] == "!reset" for s in gpu_services)
    for svc_name, svc in override.items():
        args = svc["build"]["args"]
        assert args["BASE_IMAGE"] == "${KVFUSE_BASE_IMAGE:-python:3.11-slim}"
        # `-`, not `:-`: an empty KVFUSE_TORCH_INDEX_URL means pip's configured index (Dockerfile)
        assert args["TORCH_INDEX_URL"] == "${KVFUSE_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
        if svc_name in gpu_services:
            assert svc["image"] == "kvfuse:cpu"
            assert svc["environment"] == {"KVFUSE_MODEL__DEVICE": "cpu", "KVFUSE_MODEL__DTYPE": "float32"}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_redis_image_and_published_port_can_be_chosen(name: str):
    services = load_compose(name)["services"]
    assert services["redis"]["image"] == "${KVFUSE_REDIS_IMAGE:-redis:7.4-alpine}"
    assert services[KVFUSE_SERVICES[name][0]]["ports"] == ["${KVFUSE_PUBLISH:-8000}:8000"]


def test_the_image_prepares_models_any_user_reads_and_takes_pips_index_when_told(dockerfile: str):
    prepare = _instruction(dockerfile, "RUN pip install --no-deps")
    # prepared, checked once (the pass kept beside the models, so containers start without the check),
    # then made readable by the service user, the kept pass included
    assert "kvfuse models prepare && kvfuse models check default" in prepare
    assert prepare.endswith('&& chmod -R a+rX "$KVFUSE_MODEL_CACHE_DIR"')
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in dockerfile


# -- the compose file's Redis, run ------------------------------------------------------------------------
def compose_redis_script(name: str, secret: Path, acl: Path, *extra: str) -> str:
    """The compose file's Redis command as a shell script for this machine: its secret and ACL file where
    given, `extra` redis-server arguments appended (port, bind, dir, TLS)."""
    script = load_compose(name)["services"]["redis"]["command"][2].replace("$$", "$")
    script = script.replace(SECRETS_DIR + "redis_password", str(secret)).replace("/tmp/users.acl", str(acl))
    return script + " " + " ".join(shlex.quote(a) for a in extra)


def start_compose_redis(name: str, root: Path, port: int, password: str, *extra: str) -> subprocess.Popen:
    """A redis-server started by the compose file's own command on `port`, once its user `kvfuse` answers."""
    import redis
    from redis_server import answering

    secret = root / "redis_password"
    secret.write_text(password + "\n")
    script = compose_redis_script(name, secret, root / "users.acl", "--port", str(port), "--bind", "127.0.0.1",
                                  "--dir", str(root), "--appendonly", "no", "--save", "", *extra)
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, username="kvfuse", password=password, socket_connect_timeout=0.5)
    return answering(proc, client, f"the compose file's redis-server did not start on {port}")


def test_the_compose_redis_refuses_anyone_but_its_user_and_admin_commands(tmp_path: Path):
    import shutil

    import redis
    from redis_server import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port, password = free_port(), "pw-from-a-secret"
    proc = start_compose_redis("docker-compose.yml", tmp_path, port, password)
    try:
        assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0  # the written ACL file is private
        for who in ({}, {"password": password}, {"username": "kvfuse", "password": "wrong"}):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port, **who).ping()  # no default user, no wrong password
        ok = redis.Redis(port=port, username="kvfuse", password=password)
        ok.set("kvfuse:probe", "1")
        for denied in (lambda: ok.set("other:probe", "1"), ok.flushall, lambda: ok.config_get("*"),
                       lambda: ok.keys("*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
        check = load_compose("docker-compose.yml")["services"]["redis"]["healthcheck"]["test"][1]
        check = check.replace("$$", "$").replace(SECRETS_DIR + "redis_password", str(tmp_path / "redis_password"))
        assert subprocess.run(["sh", "-c", check.replace("redis-cli", f"redis-cli -p {port}")]).returncode == 0
        (tmp_path / "redis_password").write_text("wrong")
        assert subprocess.run(["sh", "-c", check.replace("redis-cli", f"redis-cli -p {port}")],
                              capture_output=True).returncode != 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_compose_redis_refuses_to_start_without_a_password(tmp_path: Path):
    (tmp_path / "redis_password").write_text("")
    script = compose_redis_script("docker-compose.yml", tmp_path / "redis_password", tmp_path / "users.acl")
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "set KVFUSE_REDIS_PASSWORD" in out.stderr


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_the_compose_redis_keeps_kvfuses_transactions_across_a_restart(name: str, tmp_path: Path):
    """Its AOF replays MULTI/EXEC as the default user, which must keep kvfuse's rights while off: with
    none, every transaction was dropped at the restart (redis/redis#14541) and documents vanished."""
    import shutil

    import redis
    from redis_server import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port, password = free_port(), "pw-from-a-secret"
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    proc = start_compose_redis(name, tmp_path, port, password, *aof)
    try:
        client = redis.Redis(port=port, username="kvfuse", password=password)
        with client.pipeline(transaction=True) as tx:
            tx.set("kvfuse:in-a-transaction", "1").hset("kvfuse:doc", "status", "ready").execute()
        client.set("kvfuse:alone", "1")
    finally:
        proc.terminate()
        proc.wait(10)
    proc = start_compose_redis(name, tmp_path, port, password, *aof)
    try:
        client = redis.Redis(port=port, username="kvfuse", password=password)
        assert client.get("kvfuse:in-a-transaction") == b"1" and client.hget("kvfuse:doc", "status") == b"ready"
        assert client.get("kvfuse:alone") == b"1"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="default", password=password).ping()  # still off
    finally:
        proc.terminate()
        proc.wait(10)
