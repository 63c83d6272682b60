"""README "Quick start: a LAN", followed to the letter on a LAN made of network namespaces.

The hub and the sites are namespaces on one bridge with exactly the README's addresses
(they exist only inside the namespaces). The configuration files and the shell blocks
are taken from README.md itself and run unchanged (the other sites' files are made by
the substitutions the README names), so the test fails as soon as the README drifts
from what works. site-a3 takes the README's other path: no `discovery` in its file and
`fedagent join --interface`, which must be recorded in the file.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
import tomllib
from pathlib import Path

import pytest
from netns import Lab, requires_netns

from fedagent import config
from fedagent.errors import FedagentError
from fedagent.node.control import request

pytestmark = [pytest.mark.root, requires_netns]

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$", re.M)


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _blocks(text: str) -> list[tuple[str, str]]:
    """Fenced code blocks as (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)


class QuickStart:
    """What README's LAN section says, parsed."""

    def __init__(self) -> None:
        section = _section(README.read_text(), "Quick start: a LAN")
        blocks = _blocks(section)
        tomls = [b for lang, b in blocks if lang == "toml"]
        shells = [b for lang, b in blocks if lang == "sh"]
        assert len(tomls) == 2 and len(shells) == 2, "the LAN quick start's blocks changed shape"
        self.coordinator_toml, self.site_toml = tomls
        self.hub_sh, self.site_sh = shells
        coord = tomllib.loads(self.coordinator_toml)
        self.federation = coord["federation"]
        self.hub_ip = coord["discovery"]["interfaces"][0]
        site = tomllib.loads(self.site_toml)
        self.first = site["id"]
        self.first_ip = site["discovery"]["interfaces"][0]
        self.first_shard = site["task"]["shard"]
        prose = re.sub(r"\s+", " ", _FENCE.sub("", section))
        # "(site-a2: `site-a2`, `192.168.1.12`, `shard = 1`; ...)": the other sites.
        self.others = {
            name: (ip, int(shard))
            for name, ip, shard in re.findall(r"(site-\w+): `\1`, `([\d.]+)`, `shard = (\d+)`", prose)
        }
        assert self.others, "the LAN quick start no longer says how the other sites' files differ"
        m = re.search(r"`(fedagent join \S+ --interface \S+ --config \S+)`", prose)
        assert m, "the LAN quick start no longer shows `join --interface`"
        self.join_interface = m.group(1)
        m = re.search(r"`(fedagent status --config \S+)`", prose)
        assert m, "the LAN quick start no longer shows `fedagent status`"
        self.status = m.group(1)

    def site_files(self, name: str, ip: str, shard: int) -> tuple[str, str]:
        """The site's config file and shell block, made from site-a1's as the README says."""

        def sub(text: str) -> str:
            text = text.replace(self.first_ip, ip).replace(self.first, name)
            return text.replace(f"shard = {self.first_shard},", f"shard = {shard},")

        return sub(self.site_toml), sub(self.site_sh)


def _facts(peers: dict) -> dict:
    """A peer table without its clock readings (two requests are a moment apart)."""
    return {pid: {k: v for k, v in row.items() if k != "last_seen"} for pid, row in peers.items()}


def _status(sock: Path) -> dict | None:
    try:
        return request(sock, "status", timeout=2)
    except FedagentError:
        return None


@pytest.fixture
def quick() -> QuickStart:
    return QuickStart()


@pytest.fixture
def lan(tmp_path, quick):
    hosts = {"hub": quick.hub_ip, quick.first: quick.first_ip, **{n: ip for n, (ip, _) in quick.others.items()}}
    lab = Lab(tmp_path, list(hosts), addresses=hosts)
    try:
        lab.up()
        yield lab
    finally:
        lab.close()


def _shell(lab: Lab, host: str, directory: Path, script: str) -> None:
    """Run a README shell block in ``directory`` on ``host``; ``&`` jobs stay in its
    process group (killed by lab.close())."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/sbin:/usr/bin:/bin"}
    lab.spawn(host, host, ["bash", "-c", f"cd {directory} && set -x\n{script}\nwait"], env=env)


def test_lan_quick_start_verbatim(lan, quick, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "coordinator.toml").write_text(quick.coordinator_toml)
    _shell(lan, "hub", hub, quick.hub_sh)
    coord_sock = config.load(hub / "coordinator.toml", "coordinator").control_socket
    lan.wait_for(lambda: (_status(coord_sock) or {}).get("connection") == "connected", 60, "coordinator connected")

    sites = {quick.first: (quick.first_ip, quick.first_shard), **quick.others}
    by_interface = list(sites)[-1]  # the README's other way: `join --interface`, no [discovery]
    socks = {}
    for name, (ip, shard) in sites.items():
        d = tmp_path / name
        (d / "pki").mkdir(parents=True)
        for f in ("ca.crt", f"{name}.crt", f"{name}.key"):  # "copy ... into pki/ on that site"
            shutil.copy(hub / "pki" / f, d / "pki" / f)
        toml, sh = quick.site_files(name, ip, shard)
        if name == by_interface:
            # The agent runs first (on loopback, the default), then `join --interface`
            # records the address and moves the running agent's mDNS there.
            toml = "\n".join(line for line in toml.splitlines() if not line.startswith("discovery"))
            join = quick.join_interface.replace(quick.first_ip, ip).replace(quick.first, name)
            start = next(line for line in sh.splitlines() if line.startswith("fedagent agent "))
            sh = f"{start}\nuntil [ -S run/agent.sock ]; do sleep 0.2; done\n{join}"
        (d / f"{name}.toml").write_text(toml)
        socks[name] = config.load(d / f"{name}.toml", "agent").control_socket
        _shell(lan, name, d, sh)

    rounds = tomllib.loads(quick.coordinator_toml)["rounds"]["rounds"]
    # The quick start's quorum is every site, so no round starts without all of them.
    assert tomllib.loads(quick.coordinator_toml)["rounds"]["min_agents"] == len(sites)

    def finished():
        s = _status(coord_sock)
        return s if s and s.get("phase") == "done" else None

    final = lan.wait_for(finished, 90, f"{rounds} rounds on the LAN")
    assert final["completed_rounds"] == rounds and final["model_version"] == rounds

    def agent_finished(sock: Path) -> dict | None:
        # The coordinator is done before each agent has received and scored the final
        # model; until it has, the agent says "evaluating the final model, version N".
        s = _status(sock)
        return s if s is not None and s.get("round_state") == "finished" else None

    for name, (ip, _) in sites.items():
        log = lan.log(name)
        assert f"found broker mqtts://{quick.hub_ip}:8883" in log, log[-2000:]
        s = lan.wait_for(lambda sock=socks[name]: agent_finished(sock), 30, f"{name} to score the final model")
        assert s["federation"] == quick.federation and s["connection"] == "connected"
        assert s["final_model_version"] == rounds
        assert s["rounds_trained"] == rounds
        # The running agent browses on its LAN address: it sees the coordinator's advert,
        # and `status` and `peers` show the same table.
        assert s["peers"]["coordinator"]["mdns"] is True and s["peers"]["coordinator"]["online"] is True
        peers = request(socks[name], "peers", timeout=5)["peers"]
        assert _facts(peers) == _facts(s["peers"])
        # The final model is evaluated, not only the one each round started from.
        assert s["global_model_eval"]["model_version"] == rounds
        recorded = config.load(tmp_path / name / f"{name}.toml", "agent")
        assert recorded.federation == quick.federation and recorded.interfaces == (ip,)
    log = lan.log(by_interface)
    assert f"and mDNS interfaces {sites[by_interface][0]}" in log
    assert f"the running agent {by_interface} is joining {quick.federation}" in log
    assert f"mDNS now runs on {sites[by_interface][0]}" in log

    # The coordinator: the federation's held-out accuracy of the final model (every agent's
    # evaluation, weighted), its agents seen over MQTT and on mDNS, refusals in one place.
    c = lan.wait_for(
        lambda: (lambda s: s if s and len(s["held_out"].get("agents", [])) == len(sites) else None)(
            _status(coord_sock)
        ),
        20,
        "every agent's evaluation of the final model at the coordinator",
    )
    assert c["held_out"]["model_version"] == rounds and 0.5 < c["held_out"]["metrics"]["accuracy"] <= 1
    assert set(c["peers"]) == set(sites)
    assert all(row["online"] is True and row["mdns"] is True for row in c["peers"].values()), c["peers"]
    assert _facts(request(coord_sock, "peers", timeout=5)["peers"]) == _facts(c["peers"])
    assert {r["reason"] for r in c["recent_rejections"]} <= set(c["rejected"])

    # The README's status commands, as an operator types them (shown with -s).
    path = f"PATH={Path(sys.executable).parent}:$PATH"
    out = lan.run("hub", "bash", "-c", f"cd {hub} && COLUMNS=120 {path} fedagent status --config coordinator.toml")
    print(out.stdout)
    assert "held-out (agents)" in out.stdout and f"{rounds} aggregated of {rounds}" in out.stdout
    out = lan.run(
        quick.first,
        "bash",
        "-c",
        f"cd {tmp_path / quick.first} && COLUMNS=120 {path} {quick.status}",
    )
    print(out.stdout)
    assert f"fedagent agent {quick.first}" in out.stdout and "connected" in out.stdout

    # Cut site-a1 off (TCP stays open, as in a real partition): its own status says the
    # broker is unresponsive within the keep-alive, and no longer claims peers online.
    keepalive = 10.0  # fedagent's MQTT keep-alive (Transport default)
    lan.cut(quick.first)
    t0 = time.monotonic()
    cut = lan.wait_for(
        lambda: (lambda s: s if s and s["connection"] == "unresponsive" else None)(_status(socks[quick.first])),
        3 * keepalive,
        "the cut-off agent to notice",
    )
    noticed = time.monotonic() - t0
    print(f"cut-off agent reported its broker unresponsive after {noticed:.1f} s")
    assert noticed <= keepalive
    assert all(row["online"] is None for row in cut["peers"].values()), cut["peers"]
