"""Bad input an audit found accepted: fractional, empty and bit-unit sizes, non-finite counts, ``--top 0`` and
duplicate YAML keys. Each is one line on stderr and exit 2; the valid forms beside them still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.files import read_yaml
from parsim.units import parse_size, parse_size_range

ROOT = Path(__file__).resolve().parents[1]
TINY_SEARCH = ["search", "--model", "tiny-gpt", "--gpus", "8", "--global-batch", "8", "--simulate", "0"]


def refused(capsys, argv: list[str]) -> str:
    """The one line ``argv`` is refused with (exit 2, nothing on stdout)."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    return err


# --------------------------------------------------------------------------- sizes
def test_whole_byte_sizes_are_read_exactly():
    assert parse_size("1.5KiB") == 1536 and parse_size("8GiB") == 8 * 2**30 and parse_size("8GB") == 8 * 10**9
    assert parse_size("1.1KB") == 1100  # exact: float arithmetic makes 1100.0000000000002
    assert parse_size(" 8 GiB ") == 8 * 2**30 and parse_size("1024K") == 2**20 and parse_size(25e6) == 25_000_000
    assert parse_size_range("1MiB:8GiB:8") == [2**20, 2**23, 2**26, 2**29, 2**32]


@pytest.mark.parametrize("text, message", [
    ("1.5", "not a whole number of bytes"),
    (1.5, "not a whole number of bytes"),
    ("1.0001KB", "not a whole number of bytes"),  # 1000.1 B
    ("1e-9999", "not a whole number of bytes"),
    ("", "size is empty"),
    ("  ", "size is empty"),
    ("8Gb", "a lowercase b means bits; write 8GB or 8GiB (bytes)"),
    ("8 Mib", "write 8MB or 8MiB"),
    ("8kb", "write 8KB or 8KiB"),
    ("64b", "write 64B (bytes)"),
    ("1e99999", "not understood"),  # an exponent too long to count exactly is not a size anyone writes
])
def test_sizes_that_are_not_whole_bytes_are_refused(text, message):
    with pytest.raises(ParsimError, match="^size") as err:
        parse_size(text)
    assert message in str(err.value)


@pytest.mark.parametrize("sweep, message", [
    ("1Mb:8GiB:8", "size '1Mb': a lowercase b means bits"),
    ("1MiB:8Gb", "size '8Gb'"),
    ("1.5:8KiB", "not a whole number of bytes"),
    ("1KiB:", "size is empty"),
])
def test_sweeps_follow_the_same_rules(sweep, message):
    with pytest.raises(ParsimError) as err:
        parse_size_range(sweep)
    assert message in str(err.value)


@pytest.mark.parametrize("flags, message", [
    (["--size", "1.5"], "size '1.5' is not a whole number of bytes"),
    (["--size", ""], "size is empty"),
    (["--size", "8Gb"], "write 8GB or 8GiB"),
    (["--sweep", "1Mb:8GiB:8"], "a lowercase b means bits"),
])
def test_collective_refuses_bad_sizes(capsys, flags, message):
    assert message in refused(capsys, ["collective", "all-reduce", *flags])


@pytest.mark.parametrize("flags", [["--size", "1.5KiB"], ["--size", "8GB"], ["--sweep", "1MiB:8GiB:8"]])
def test_collective_takes_whole_byte_sizes(capsys, flags):
    assert main(["collective", "all-reduce", "--gpus", "2", *flags]) == 0
    capsys.readouterr()


def test_a_token_batch_that_is_not_whole_tokens_speaks_of_tokens(capsys):
    err = refused(capsys, TINY_SEARCH[:-4] + ["--global-batch", "0.3M-tokens"])
    assert "--global-batch '0.3M-tokens': give a whole number of tokens" in err


# --------------------------------------------------------------------------- counts and numbers
@pytest.mark.parametrize("flags, message", [
    (["--tokens", "1e400"], "--tokens '1e400': give a finite, positive count"),
    (["--tokens", "1e300T"], "finite, positive count"),
    (["--top", "0"], "--top 0: give a count >= 1"),
    (["--top=-1"], "--top -1: give a count >= 1"),
    (["--simulate=-1"], "--simulate -1: give a count >= 0"),
])
def test_search_refuses_counts_it_cannot_use(capsys, flags, message):
    assert message in refused(capsys, TINY_SEARCH + flags)


def test_search_shows_one_row_with_the_fast_tier_alone(capsys):
    assert main(TINY_SEARCH + ["--top", "1", "--tokens", "2B", "--json"]) == 0
    assert '"ranked"' in capsys.readouterr().out


FLOAT_FLAGS = [  # every float flag of the CLI, with a command that reaches its check
    (TINY_SEARCH, "--price-per-gpu-hour"), (TINY_SEARCH, "--grad-clip"),
    (["simulate", "tiny-pp2"], "--grad-clip"),
    (["simulate", "mixtral-8x22b"], "--expert-load"), (["simulate", "mixtral-8x22b"], "--capacity-factor"),
    *[(["explain", "bubble", "--schedule", "zero-bubble"], flag) for flag in ("--tf", "--tb", "--tw", "--tcomm")],
    (["bench", "all-reduce", "--size", "4KiB"], "--timeout"), (["run", "tiny-pp2"], "--timeout"),
    (["compare", "all-reduce", "--cluster", "dgx-h100", "--size", "1MiB"], "--timeout"),
]


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
@pytest.mark.parametrize("command, flag", FLOAT_FLAGS)
def test_no_float_flag_takes_a_non_finite_number(capsys, command, flag, value):
    assert flag.lstrip("-").replace("-", "_") in refused(capsys, [*command, f"{flag}={value}"]).replace("-", "_")


def test_calibrate_refuses_a_non_finite_timeout(capsys, tmp_path):
    assert "--timeout" in refused(capsys, ["calibrate", "--out", str(tmp_path / "x.yaml"), "--timeout", "inf"])


# --------------------------------------------------------------------------- YAML
def test_a_duplicate_key_is_refused_with_its_name_file_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: x\nnetwork:\n  latency_us: 1\n  bw: 2\n  latency_us: 3\n")
    with pytest.raises(ParsimError) as err:
        read_yaml(path)
    assert str(err.value).startswith(str(path)) and "line 5" in str(err.value)
    assert "key 'latency_us' appears twice (first at line 3)" in str(err.value)


def test_a_key_overriding_a_merged_one_is_not_a_duplicate(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {a: 1, b: 2}\nchild:\n  <<: *b\n  a: 3\n")
    assert read_yaml(path) == {"base": {"a": 1, "b": 2}, "child": {"a": 3, "b": 2}}


def _with_first_key_again(source: Path, dest: Path) -> Path:
    """``source`` with its first top-level key written once more at the end."""
    text = source.read_text()
    key = next(line.split(":")[0] for line in text.splitlines() if line[:1].isalpha() and ":" in line)
    dest.write_text(f"{text.rstrip()}\n{key}: again\n")
    return dest


@pytest.mark.parametrize("kind, source, argv", [
    ("cluster", "topologies/dgx-h100.yaml", ["collective", "all-reduce", "--cluster", "{}"]),
    ("plan", "parsim/presets/plans/tiny-pp2.yaml", ["simulate", "{}"]),
    ("model", "parsim/presets/tiny-gpt.yaml", ["search", "--model", "{}", "--gpus", "8", "--simulate", "0"]),
])
def test_cluster_plan_and_model_files_refuse_duplicate_keys(capsys, tmp_path, kind, source, argv):
    path = _with_first_key_again(ROOT / source, tmp_path / f"{kind}.yaml")
    err = refused(capsys, [a.format(path) for a in argv])
    assert str(path) in err and "appears twice" in err


def test_every_builtin_yaml_file_still_loads():
    files = [p for folder in ("topologies", "parsim/presets", "parsim/validation")
             for p in sorted((ROOT / folder).rglob("*.yaml"))]
    assert len(files) > 20
    for path in files:
        assert read_yaml(path) is not None
