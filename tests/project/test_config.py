"""Config files: validation with errors that name the file and the key; custom tasks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedagent import config
from fedagent.config import GossipSettings, TlsConfig
from fedagent.errors import ConfigError
from fedagent.node.discovery import not_found_message  # zeroconf's first import runs ldconfig: at collection
from fedagent.tasks.base import load_task

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "agent.toml"
    p.write_text(text)
    return p


def test_render_then_load_roundtrip(tmp_path):
    tls = TlsConfig(ca=Path("ca.crt"), cert=Path("a.crt"), key=Path("a.key"))
    p = write(
        tmp_path,
        config.render(
            node_id="agent-a",
            federation="fed-1",
            tls=tls,
            state_dir=Path("state"),
            task_options={"shard": 1, "shards": 3},
        ),
    )
    cfg = config.load(p, "agent")
    assert cfg.id == "agent-a" and cfg.federation == "fed-1" and cfg.broker == ""
    assert cfg.tls.ca == tmp_path / "ca.crt"  # relative to the file
    assert cfg.state_dir == tmp_path / "state"
    assert cfg.task == "digits" and cfg.task_options == {"shard": 1, "shards": 3}
    assert cfg.search.space == "joint"


def test_search_section_roundtrip(tmp_path):
    tls = TlsConfig(ca=Path("ca.crt"), cert=Path("a.crt"), key=Path("a.key"))
    p = write(
        tmp_path,
        config.render(
            node_id="agent-a",
            federation="fed-1",
            tls=tls,
            state_dir=Path("state"),
            search={"space": "mapped", "public_corpus": "freebsd-manpages", "public_docs": 40, "mapper_epochs": 20},
        ),
    )
    s = config.load(p, "agent").search
    assert (s.space, s.public_corpus, s.public_docs, s.mapper_epochs, s.mapper_hidden) == (
        "mapped",
        "freebsd-manpages",
        40,
        20,
        1200,
    )


@pytest.mark.parametrize(
    "text, words",
    [
        ('id = "Agent_A"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "invalid id"),
        ('id = "a"\nfederation = "x/#"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "invalid federation"),
        ('id = "a"\nmode = "p2p"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "mode must be"),
        ('id = "a"\ncolour = 1\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "unknown key colour"),
        ('id = "a"\n[broker]\nuri = "tcp://x:1"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "mqtts://"),
        ('id = "a"\n[tls]\nca="a"\n', "[tls] cert is required"),
        ('id = "a"\n[rounds]\nbogus = 1\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[rounds]"),
        ('id = "a"\n[search]\nspace = "shared"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "space must be one of"),
        ('id = "a"\n[search]\npublic_docs = 0\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "public_docs"),
        ('id = "a"\n[search]\npublic_corpus = "slack"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "public_corpus must be"),
        ('id = "a"\n[search]\nbogus = 1\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[search]"),
        ("id = [", "cannot read config"),
        ('id = "a"\n[discovery]\ninterfaces = ["eth0"]\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "not an interface name"),
        ('id = "a"\n[discovery]\ninterfaces = "10.0.0.1"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "must be a list"),
        ('id = "a"\n[discovery]\ninterfaces = []\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "non-empty list"),
        ('id = "a"\n[discovery]\ninterface = ["10.0.0.1"]\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[discovery]"),
        ('id = "a"\n[transfer]\ncompresion = "none"\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[transfer]"),
        ('id = "a"\n[broker]\nkeep_alive = 30\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[broker]"),
        ('id = "a"\n[tls]\nca="a"\ncert="b"\nkey="c"\ncrl="d"\n', "[tls]"),
        ('id = "a"\n[security]\nmax_skew = 10\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "[security]"),
        ('id = "a"\nhistory_max_bytes = 1000\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "history_max_bytes must be"),
        ('id = "a"\nhistory_keep = 0\n[tls]\nca="a"\ncert="b"\nkey="c"\n', "history_keep must be"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        config.load(write(tmp_path, text), "agent")
    assert words in str(err.value) and "agent.toml" in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", "agent")


def test_coordinator_needs_a_broker(tmp_path):
    p = write(tmp_path, 'id = "c"\nfederation = "f"\n[tls]\nca="a"\ncert="b"\nkey="c"\n')
    with pytest.raises(ConfigError, match=r"\[broker\] uri is required"):
        config.load(p, "coordinator")


def test_update_membership_keeps_other_keys(tmp_path):
    tls = TlsConfig(ca=Path("ca.crt"), cert=Path("a.crt"), key=Path("a.key"))
    p = write(tmp_path, config.render(node_id="agent-a", federation="", tls=tls, state_dir=Path("s")))
    config.update_membership(p, "fed-2", "mqtts://127.0.0.1:1883")
    cfg = config.load(p, "agent")
    assert (cfg.federation, cfg.broker, cfg.id) == ("fed-2", "mqtts://127.0.0.1:1883", "agent-a")


def test_join_and_leave_keep_the_operators_comments(tmp_path):
    p = write(
        tmp_path,
        "# site 3, rack B\n"
        'id = "agent-a"  # printed on the box\n'
        'federation = ""\n'
        'state_dir = "s"\n\n'
        "[tls]\n# issued by the hospital CA\n"
        'ca = "ca.crt"\ncert = "a.crt"\nkey = "a.key"\n\n'
        "[discovery]\n"
        'interfaces = ["127.0.0.1"]  # the lab VLAN\n',
    )
    config.update_membership(p, "lab", "mqtts://192.168.1.10:8883", ("192.168.1.11",))
    text = p.read_text()
    for comment in ("# site 3, rack B", "# printed on the box", "# issued by the hospital CA", "# the lab VLAN"):
        assert comment in text
    cfg = config.load(p, "agent")
    assert (cfg.federation, cfg.broker, cfg.interfaces) == ("lab", "mqtts://192.168.1.10:8883", ("192.168.1.11",))
    config.update_membership(p, "", "")
    assert "# site 3, rack B" in p.read_text()
    assert config.load(p, "agent").federation == ""


def test_membership_with_a_dotted_broker_key_is_still_written_right(tmp_path):
    p = write(
        tmp_path,
        'id = "agent-a"\nfederation = ""\nstate_dir = "s"\nbroker.uri = "mqtts://old:8883"\n'
        '[tls]\nca = "ca.crt"\ncert = "a.crt"\nkey = "a.key"\n',
    )
    config.update_membership(p, "lab", "mqtts://new:8883")
    cfg = config.load(p, "agent")
    assert (cfg.federation, cfg.broker) == ("lab", "mqtts://new:8883")


def test_custom_task_by_module_attribute(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    task = load_task("custom_task:make", {"features": 4})
    model = task.build_model()
    before = task.evaluate(model)["accuracy"]
    task.fit(model, epochs=20, lr=0.5, batch_size=16, seed=0)
    assert task.evaluate(model)["accuracy"] > max(before, 0.8)
    sys.modules.pop("custom_task", None)


@pytest.mark.parametrize("name", ["nosuchtask", "json:nothing_here", "fedagent.tasks.digits:DigitsMLP"])
def test_bad_task_names(name):
    with pytest.raises(ConfigError):
        load_task(name, {})


def test_digits_split_is_non_iid_and_disjoint():
    tasks = [load_task("digits", {"shard": i, "shards": 3, "alpha": 0.3}) for i in range(3)]
    sizes = [t.num_samples() for t in tasks]
    full = load_task("digits", {})
    assert sum(sizes) == full.num_samples()
    # label skew: some shard lacks at least one class entirely
    assert any(len(set(t.y_train.tolist())) < 10 for t in tasks)


def test_join_interface_is_recorded_with_the_membership(tmp_path):
    tls = TlsConfig(ca=Path("ca.crt"), cert=Path("a.crt"), key=Path("a.key"))
    p = write(tmp_path, config.render(node_id="agent-a", federation="", tls=tls, state_dir=Path("s")))
    assert config.load(p, "agent").interfaces == ("127.0.0.1",)
    config.update_membership(p, "lab", "mqtts://192.168.1.10:8883", ("192.168.1.11",))
    cfg = config.load(p, "agent")
    assert (cfg.federation, cfg.interfaces) == ("lab", ("192.168.1.11",))
    config.update_membership(p, "", "")  # leave keeps the interfaces: they belong to the machine
    assert config.load(p, "agent").interfaces == ("192.168.1.11",)
    with pytest.raises(ConfigError, match="--interface: 'eth0' is not an IPv4 address"):
        config.update_membership(p, "lab", "", ("eth0",))


def test_join_cli_refuses_an_interface_name_before_searching(tmp_path):
    from click.testing import CliRunner

    from fedagent.cli import main

    tls = TlsConfig(ca=Path("ca.crt"), cert=Path("a.crt"), key=Path("a.key"))
    p = write(tmp_path, config.render(node_id="agent-a", federation="", tls=tls, state_dir=Path("s")))
    out = CliRunner().invoke(main, ["join", "lab", "--interface", "eth0", "--config", str(p)])
    assert out.exit_code != 0 and "not an IPv4 address" in out.output and "looking for" not in out.output
    assert config.load(p, "agent").federation == ""


def test_mdns_not_found_says_where_it_searched_and_how_to_search_elsewhere():
    msg = not_found_message("lab", ("coordinator", "broker"), 10, ["127.0.0.1"])
    assert "searched on 127.0.0.1" in msg and "reaches only this machine" in msg
    assert "fedagent join lab --interface ADDRESS" in msg and "[discovery] interfaces" in msg and "--broker" in msg
    assert "only this machine" not in not_found_message("lab", ("coordinator",), 10, ["192.168.1.11"])


def test_gossip_sends_count_fanout_only_with_a_screening_merge():
    # what a local-DP target epsilon is spread over: push-sum sends one model a period
    # whatever fanout says; a screening merge sends one to each of `fanout` peers
    assert GossipSettings(periods=40, fanout=3).sends() == 40
    assert GossipSettings(periods=40, fanout=3, aggregation="median", byzantine=1).sends() == 120


TLS = '[tls]\nca = "ca.crt"\ncert = "a.crt"\nkey = "a.key"\n'


@pytest.mark.parametrize(
    "body, words",
    [
        (
            '[discovery]\nadvertise = "false"\n',
            '[discovery] advertise must be true or false (without quotes), not "false"',
        ),
        ('metrics_port = "abc"\n', 'metrics_port must be an integer in [-1, 65535], not "abc"'),
        ('torch_threads = "two"\n', 'torch_threads must be an integer in [1, 4096], not "two"'),
        ("torch_threads = 2.0\n", "torch_threads must be an integer in [1, 4096], not 2.0"),
        (
            "[rounds]\nmin_agent = 2\n",
            "unknown key [rounds] min_agent (did you mean min_agents?); [rounds] takes: rounds",
        ),
        ("[rounds]\nrounds = 0\n", "[rounds] rounds must be an integer >= 1, not 0"),
        ('[rounds]\nlr = "0.1"\n', '[rounds] lr must be a number in (0, 100), not "0.1"'),
        ("[rounds]\nmax_norm = -1.0\n", "[rounds] max_norm must be a positive number, not -1.0"),
        (
            '[rounds]\nlr_schedule = "linear"\n',
            '[rounds] lr_schedule must be one of "constant", "cosine", not "linear"',
        ),
        ("[broker]\nkeepalive = 1\n", "[broker] keepalive must be an integer in [2, 65535], not 1"),
        ('[transfer]\nstream_updates = "yes"\n', '[transfer] stream_updates must be true or false, not "yes"'),
        ("[security]\nmax_clock_skew = nan\n", "[security] max_clock_skew must be a finite number"),
        ("[gossip]\nfanout = 0\n", "[gossip] fanout must be an integer >= 1, not 0"),
        ('[gossip]\nexchange = "in_embed.*"\n', '[gossip] exchange must be a list of strings, not "in_embed.*"'),
        ("[syncopt]\nfloat64 = 1\n", "[syncopt] float64 must be true or false, not 1"),
        ("rounds = 5\n", "[rounds] must be a table, not 5"),
        ('[tls]\nca = ""\n', "[tls] ca must be a path (a non-empty string)"),
        # What a machine would refuse later is refused at load, on an agent too.
        ('[rounds]\naggregation = "krum"\nbyzantine = 1\n', "Krum needs n > 2f + 2"),
        ("[rounds]\nmin_agents = 2\nmin_updates = 3\n", "min_updates cannot exceed min_agents"),
        ('[rounds]\naggregation = "median"\n[transfer]\nstream_updates = true\n', "stream_updates = true"),
        ('[gossip]\naggregation = "median"\nbyzantine = 1\n', "raise min_peers to 2"),
        ('mode = "gossip"\n[privacy]\nmode = "local"\ntarget_epsilon = 2.0\n', "needs [gossip] periods"),
    ],
)
def test_values_are_checked_strictly_with_file_table_and_key(tmp_path, body, words):
    text = 'id = "agent-a"\n' + body + ("" if "[tls]" in body else TLS)
    if body.startswith("[tls]"):
        text += 'cert = "a.crt"\nkey = "a.key"\n'
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config.load(path, "agent")
    message = str(err.value)
    assert words in message and message.startswith(f"{path}: ") and "\n" not in message


def test_known_keys_of_a_table_are_listed_for_a_typo(tmp_path):
    with pytest.raises(ConfigError) as err:
        config.load(write(tmp_path, 'id = "agent-a"\n[rounds]\nmin_agent = 2\n' + TLS), "agent")
    known = str(err.value).partition("[rounds] takes: ")[2].split(", ")
    assert known == [f.name for f in dataclasses.fields(config.RoundsConfig)]


def test_integers_are_taken_for_numbers_and_valid_values_load(tmp_path):
    text = (
        'id = "agent-a"\nmetrics_port = 9100\n[discovery]\nadvertise = false\n'
        "[rounds]\nlr = 1\nserver_lr = 2\n[gossip]\nouter_step = 2\n" + TLS
    )
    cfg = config.load(write(tmp_path, text), "agent")
    assert cfg.advertise is False and cfg.metrics_port == 9100
    assert cfg.rounds.lr == 1.0 and type(cfg.rounds.lr) is float and cfg.gossip.outer_step == 2.0


def _cli(role: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedagent", role, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.procs
@pytest.mark.parametrize(
    "role, body, words",
    [
        ("agent", '[discovery]\nadvertise = "false"\n', "[discovery] advertise must be true or false (without quotes)"),
        ("agent", "[rounds]\nmin_agent = 2\n", "unknown key [rounds] min_agent (did you mean min_agents?)"),
        ("agent", 'metrics_port = "abc"\n', 'metrics_port must be an integer in [-1, 65535], not "abc"'),
        ("agent", 'torch_threads = "two"\n', 'torch_threads must be an integer in [1, 4096], not "two"'),
        ("coordinator", '[rounds]\naggregation = "median"\nbyzantine = 1\n', "f < n/2"),
        ("coordinator", '[transfer]\ncompression = "zip"\n', '[transfer] compression must be one of "none"'),
    ],
)
def test_daemons_exit_78_with_one_line_naming_the_key(tmp_path, role, body, words):
    head = 'id = "node-a"\nfederation = "lab"\n'
    if role == "coordinator":
        body += '[broker]\nuri = "mqtts://127.0.0.1:8883"\n'
    path = write(tmp_path, head + body + TLS)
    run = _cli(role, path)
    assert run.returncode == 78, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"error: {path}: ") and words in lines[0]


def test_task_file_options_are_relative_to_the_config_file(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "data").mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4))
    np.savetxt(site / "data" / "site0.csv", np.column_stack([x, x[:, 0] > 0]), delimiter=",")
    path = site / "agent.toml"
    path.write_text('id = "agent-a"\n[task]\nname = "custom_task:make"\ncsv = "data/site0.csv"\nfeatures = 4\n' + TLS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a service's working directory is not the config's
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    cfg = config.load(path, "agent")
    assert cfg.task_options == {"csv": "data/site0.csv", "features": 4}  # as written
    assert cfg.task_options.path("csv") == site / "data" / "site0.csv"
    task = load_task(cfg.task, cfg.task_options)
    assert task.num_samples() == 40  # 80 % of the file's 50 rows: it was read
    sys.modules.pop("custom_task", None)


def test_built_in_tasks_declare_their_file_options():
    from fedagent.tasks import digits, doc2vec, word2vec

    assert word2vec.make.file_options == ("vocabulary", "reference")
    assert doc2vec.make.file_options == ("vocabulary",)
    assert not hasattr(digits.make, "file_options")
    options = config.TaskOptions({"vocabulary": "v.tsv", "seed": 1, "reference": ""}, Path("/etc/fedagent"))
    resolved = options.with_files(word2vec.make.file_options)
    assert resolved == {"vocabulary": "/etc/fedagent/v.tsv", "seed": 1, "reference": ""}
    assert config.TaskOptions({"vocabulary": "/abs/v.tsv"}).with_files(("vocabulary",))["vocabulary"] == "/abs/v.tsv"
