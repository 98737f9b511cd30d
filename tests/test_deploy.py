"""Deployment without Docker: docker-compose.yml, the ClickHouse users and ``rankscope schema``.

No Docker and no ClickHouse server run here, so the compose file is checked as data: its
services, ports, health checks and volumes; its commands go through rankscope's own parser, so
compose cannot drift from the flags; the users file gives the dashboard's user read-only access
that still allows every setting rankscope's read path sends. ``rankscope schema`` prints the DDL
the collector uses; the single-node output runs on chDB, and a collector's migration accepts the
database it made.
"""

from __future__ import annotations

import importlib
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from clickhouse_connect.driver.client import arrow_str_setting

from rankscope.cli.main import COMMANDS, build_parser, main
from rankscope.collector.query import Limits, engine_settings
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.ddl import create_statements
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import SCHEMA_VERSION, TABLES

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
USERS = ROOT / "deploy" / "clickhouse" / "users.d" / "rankscope.xml"
SERVER_CONFIG = ROOT / "deploy" / "clickhouse" / "config.d" / "rankscope.xml"
#: ${NAME}, ${NAME:-default}: the forms of compose interpolation the file uses
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """``value`` with every variable at its default, as ``docker compose`` with no .env sees it."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def users() -> ET.Element:
    return ET.parse(USERS).getroot()


def container_ports(service: dict[str, Any]) -> set[int]:
    """The container side of each ``[HOST_IP:]HOST_PORT:CONTAINER_PORT`` mapping."""
    return {int(str(p).rsplit(":", 1)[1]) for p in service["ports"]}


def published(service: dict[str, Any], port: int) -> str:
    """The host address a container port is published on ("" for every interface)."""
    mapping = next(str(p) for p in service["ports"] if str(p).endswith(f":{port}"))
    parts = mapping.split(":")
    return parts[0] if len(parts) == 3 else ""


# --- docker-compose.yml ---------------------------------------------------------------------------


def test_every_variable_has_a_default_and_is_documented() -> None:
    found = list(VARIABLE.finditer(COMPOSE.read_text()))
    # ${NAME:-} too: an empty default switches a feature (token, TLS) off.
    assert found and [m.group(0) for m in found if m.group(2) is None] == [], "docker compose up must work without a .env file"
    page = (ROOT / "docs" / "deployment.md").read_text()
    assert sorted({m.group(1) for m in found if f"`{m.group(1)}`" not in page}) == []


def test_three_services_a_pinned_clickhouse_and_one_image_for_the_others(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"clickhouse", "collector", "dashboard"}
    image = services["clickhouse"]["image"]
    name, _, tag = image.partition(":")
    assert name == "clickhouse/clickhouse-server" and re.fullmatch(r"\d+\.\d+(\.\d+)*", tag), image
    assert services["collector"]["build"] == services["dashboard"]["build"] == "."
    assert services["collector"]["image"] == services["dashboard"]["image"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert 'ENTRYPOINT ["rankscope"]' in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile  # not the multi-GB CUDA build
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


def test_the_image_installs_the_extra_of_each_command_it_runs(compose: dict[str, Any]) -> None:
    """`pip install rankscope` is the agent alone: the image adds the extras its services' commands declare."""
    installs = re.findall(r'^RUN pip install "/src\[([\w,]+)\]"', (ROOT / "Dockerfile").read_text(), re.M)
    assert len(installs) == 1, installs
    services = [s for name, s in compose["services"].items() if name != "clickhouse"]
    assert set(installs[0].split(",")) == {importlib.import_module(COMMANDS[s["command"][0]]).EXTRA for s in services}


def test_health_checks_and_start_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
        assert service.get("restart") == "unless-stopped", name
    assert services["collector"]["depends_on"] == {"clickhouse": {"condition": "service_healthy"}}
    assert services["dashboard"]["depends_on"] == {
        "clickhouse": {"condition": "service_healthy"}, "collector": {"condition": "service_healthy"}}
    assert "/_stcore/health" in " ".join(services["dashboard"]["healthcheck"]["test"])


def test_clickhouse_data_is_the_only_named_volume_and_config_is_mounted_read_only(compose: dict[str, Any]) -> None:
    assert set(compose["volumes"]) == {"clickhouse-data"}
    clickhouse = compose["services"]["clickhouse"]
    assert "clickhouse-data:/var/lib/clickhouse" in clickhouse["volumes"]
    mounts = [v for v in clickhouse["volumes"] if v.startswith("./")]
    assert {m.split(":")[1] for m in mounts} == {
        "/etc/clickhouse-server/config.d/rankscope.xml", "/etc/clickhouse-server/users.d/rankscope.xml"}
    for mount in mounts:
        source, _, mode = mount.split(":")
        assert mode == "ro" and (ROOT / source).is_file(), mount
    assert "volumes" not in compose["services"]["collector"] and "volumes" not in compose["services"]["dashboard"]


def test_ports_what_is_published_where(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert container_ports(services["clickhouse"]) == {8123}
    assert container_ports(services["collector"]) == {7777, 9464}
    assert container_ports(services["dashboard"]) == {8501}
    # Agents on other machines reach the collector; the database, the unauthenticated metrics
    # and the dashboard (no login) stay on this machine unless configured otherwise.
    assert published(services["collector"], 7777) == ""
    assert published(services["clickhouse"], 8123) == "127.0.0.1"
    assert published(services["collector"], 9464) == "127.0.0.1"
    assert published(services["dashboard"], 8501) == "127.0.0.1"


def test_commands_parse_with_rankscope_s_own_parser(compose: dict[str, Any]) -> None:
    services = compose["services"]
    parser = build_parser()
    collector = parser.parse_args(services["collector"]["command"])
    dashboard = parser.parse_args(services["dashboard"]["command"])
    passwords = services["clickhouse"]["environment"]

    writer, reader = urlsplit(collector.clickhouse), urlsplit(dashboard.clickhouse)
    assert (collector.command, writer.username, writer.password) == ("collector", "rankscope_writer", passwords["RANKSCOPE_WRITER_PASSWORD"])
    assert (dashboard.command, reader.username, reader.password) == ("dashboard", "rankscope_reader", passwords["RANKSCOPE_READER_PASSWORD"])
    database = services["clickhouse"]["environment"]["CLICKHOUSE_DB"]
    for url in (writer, reader):
        assert (url.hostname, url.port, url.path) == ("clickhouse", 8123, f"/{database}")

    host, _, port = collector.listen.rpartition(":")
    assert host == "0.0.0.0" and int(port) in container_ports(services["collector"])
    assert f"http://127.0.0.1:{collector.metrics_port}/metrics" in " ".join(services["collector"]["healthcheck"]["test"])
    assert collector.retention_days == 30
    assert dashboard.address == "0.0.0.0" and dashboard.port in container_ports(services["dashboard"])
    # Token and TLS come from the environment (empty: off), in the variables the flags read.
    assert set(services["collector"]["environment"]) == {"RANKSCOPE_TOKEN", "RANKSCOPE_TLS_CERT", "RANKSCOPE_TLS_KEY"}


# --- the ClickHouse users -------------------------------------------------------------------------


def user(users: ET.Element, name: str) -> ET.Element:
    found = users.find(f"users/{name}")
    assert found is not None, name
    return found


def grants(element: ET.Element) -> list[str]:
    return [q.text or "" for q in element.findall("grants/query")]


def test_passwords_come_from_the_compose_environment(users: ET.Element, compose: dict[str, Any]) -> None:
    environment = compose["services"]["clickhouse"]["environment"]
    for name, variable in (("rankscope_writer", "RANKSCOPE_WRITER_PASSWORD"), ("rankscope_reader", "RANKSCOPE_READER_PASSWORD")):
        password = user(users, name).find("password")
        assert password is not None and password.get("from_env") == variable and variable in environment


def test_the_writer_owns_the_database_and_nothing_else(users: ET.Element) -> None:
    given = grants(user(users, "rankscope_writer"))
    assert "GRANT ALL ON rankscope.*" in given
    assert all(" ON rankscope.*" in g or " ON system." in g for g in given)
    assert all(g.startswith("GRANT SELECT ON system.") for g in given if " ON system." in g)


def test_the_dashboard_user_is_read_only(users: ET.Element) -> None:
    reader = user(users, "rankscope_reader")
    assert all(g.startswith("GRANT SELECT ON ") for g in grants(reader))
    profile = users.find(f"profiles/{reader.findtext('profile')}")
    assert profile is not None and profile.findtext("readonly") == "1"


def test_read_only_still_allows_every_setting_the_read_path_sends(users: ET.Element) -> None:
    """readonly=1 refuses a changed setting unless it is changeable_in_readonly; the query guard
    sends its limits with every query and clickhouse-connect its Arrow string setting."""
    profile = users.find(f"profiles/{user(users, 'rankscope_reader').findtext('profile')}")
    assert profile is not None
    constraints = profile.find("constraints")
    assert constraints is not None
    sent = engine_settings(Limits())
    assert sent.pop("readonly") == 1  # equal to the profile's: not a change
    for name, value in [*sent.items(), (arrow_str_setting, 1)]:
        constraint = constraints.find(name)
        assert constraint is not None and constraint.find("changeable_in_readonly") is not None, name
        low, high = constraint.findtext("min"), constraint.findtext("max")
        assert (low is None or float(low) <= float(value)) and (high is None or float(value) <= float(high)), name
    # ClickHouse accepts changeable_in_readonly only with this server setting.
    assert ET.parse(SERVER_CONFIG).getroot().findtext("access_control_improvements/settings_constraints_replace_previous") == "true"


def test_the_default_user_is_reachable_from_inside_the_container_only(users: ET.Element) -> None:
    networks = user(users, "default").find("networks")
    assert networks is not None and networks.get("replace") == "replace"
    assert {ip.text for ip in networks.findall("ip")} == {"::1", "127.0.0.1"}


# --- rankscope schema ------------------------------------------------------------------------------


def printed_statements(capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    """``rankscope schema FLAGS`` run in this process, split back into statements."""
    assert main(["schema", *flags]) == 0
    out = capsys.readouterr().out
    assert out.endswith(";\n")
    return out.removesuffix(";\n").split(";\n\n")


def test_schema_output_runs_on_chdb_and_a_collector_then_starts_on_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    statements = printed_statements(capsys)
    assert statements == create_statements("rankscope")
    store = EmbeddedStore(tmp_path / "store")
    try:
        for statement in statements:
            store.command(statement)
        names = store.query_arrow("SELECT name FROM system.tables WHERE database = 'rankscope'")["name"].to_pylist()
        assert set(names) == {t.name for t in TABLES} | {f"{t.name}_mv" for t in TABLES if t.source}
        assert migrate(store, "rankscope", None) == SCHEMA_VERSION  # what a collector does at start-up
    finally:
        store.close()


def test_schema_for_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    statements = printed_statements(capsys, "--cluster", "c1", "--database", "obs", "--retention-days", "14")
    assert statements == create_statements("obs", retention_days=14, cluster="c1")
    assert all(" ON CLUSTER c1" in s for s in statements)
    by_start = {s.split("\n", 1)[0]: s for s in statements}
    # Replicated storage tables, each with a Distributed table of the plain name over it.
    spans = by_start["CREATE TABLE IF NOT EXISTS obs.spans_local ON CLUSTER c1"]
    assert "ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" in spans
    assert "TTL toDateTime(start_time) + INTERVAL 14 DAY" in spans
    assert ("CREATE TABLE IF NOT EXISTS obs.spans ON CLUSTER c1 AS obs.spans_local "
            "ENGINE = Distributed(c1, obs, spans_local, cityHash64(run_id, rank))") in statements  # fmt: skip
    incidents = by_start["CREATE TABLE IF NOT EXISTS obs.incidents_local ON CLUSTER c1"]
    assert "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)" in incidents
    rollup = by_start["CREATE TABLE IF NOT EXISTS obs.step_segments_local ON CLUSTER c1"]
    assert "ENGINE = ReplicatedAggregatingMergeTree(" in rollup
    # Each shard rolls up its own spans: the view reads and writes the local tables.
    view = next(s for s in statements if s.startswith("CREATE MATERIALIZED VIEW"))
    assert view.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS obs.step_segments_mv ON CLUSTER c1 TO obs.step_segments_local AS ")
    assert "FROM obs.spans_local" in view


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--cluster", "prod; DROP"], "expected a name of letters"),
        (["--database", "1db"], "expected a name of letters"),
        (["--retention-days", "0"], "must be at least 1"),
    ],
)
def test_schema_refuses_bad_names_and_days(args: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["schema", *args])
    assert exit_info.value.code == 2
    assert reason in capsys.readouterr().err
