"""The cache maintenance functions and the ``cache`` CLI on a real directory."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from kvcellar.engine.speculation import RecentOutputs
from kvcellar.paths import draft_outputs_path
from kvcellar.storage import BlockSpec
from kvcellar.storage.block_format import header_size_for
from kvcellar.storage.disk import maintenance
from kvcellar.storage.disk.cli import add_cache_commands, kv_root
from kvcellar.storage.disk.layout import key_from_block_name
from tests.storage.helpers import REPO, SPEC, chain, child_env, files

LONG_AGO = 1_000_000_000 * 10**9  # 2001


@pytest.fixture
def populated(tmp_path, open_tier):
    """cache_dir with two namespaces, an old-format directory, a corrupt block and an orphan."""
    root = kv_root(tmp_path)
    a = open_tier(root, ns="alpha", async_writes=False, descriptor={"weights": "a"})
    b = open_tier(root, ns="beta", spec=BlockSpec(torch.float32, SPEC.shape, 16), async_writes=False)
    a.store(chain(6))
    b.store(chain(3, b.spec, seed=1))
    a.close(10)
    b.close(10)
    old = root / "alpha-v0" / "blocks" / "ab"
    old.mkdir(parents=True)
    (old / ("ab" * 32 + ".kvb")).write_bytes(b"old format")
    bad = files(root / "alpha-v2", ".kvb")[0]
    with open(bad, "r+b") as f:
        f.seek(header_size_for(16) + 10)
        f.write(b"\xff\xfe")
    orphan = bad.with_name(bad.name + ".deadbeef-1.7.tmp")
    orphan.write_bytes(b"partial")
    os.utime(orphan, ns=(LONG_AGO, LONG_AGO))
    return tmp_path, bad


def test_stats(populated) -> None:
    cache_dir, _ = populated
    stats = {s.info.dir_name: s for s in maintenance.cache_stats(kv_root(cache_dir))}
    assert sorted(stats) == ["alpha-v0", "alpha-v2", "beta-v2"]
    alpha = stats["alpha-v2"]
    assert alpha.blocks == 6 and alpha.tmp_files == 1 and alpha.bytes == 6 * (header_size_for(16) + SPEC.nbytes)
    assert alpha.info.descriptor["descriptor"] == {"weights": "a"} and alpha.info.spec == SPEC
    assert alpha.oldest_access_ns is not None and alpha.live_sessions == 0 and alpha.unclean_sessions == 0
    assert stats["beta-v2"].blocks == 3 and not stats["alpha-v0"].info.current


def test_verify_deletes_bad_blocks(populated) -> None:
    cache_dir, bad = populated
    reports = {r.info.dir_name: r for r in maintenance.verify_cache(kv_root(cache_dir))}
    alpha = reports["alpha-v2"]
    assert (alpha.checked, alpha.ok, alpha.bad, alpha.deleted) == (6, 5, {"checksum": 1}, 1)
    assert not bad.exists()
    assert reports["beta-v2"].ok == 3 and not reports["beta-v2"].bad
    assert reports["alpha-v0"].skipped is not None
    again = {r.info.dir_name: r for r in maintenance.verify_cache(kv_root(cache_dir))}
    assert again["alpha-v2"].ok == 5 and not again["alpha-v2"].bad


def test_verify_finds_a_flip_in_the_header_padding(tmp_path, open_tier) -> None:
    """Issue 14, F4: ``cache verify`` reports a non-zero byte in the header padding."""
    root = kv_root(tmp_path)
    tier = open_tier(root, async_writes=False)
    tier.store(chain(3))
    tier.close(10)
    victim = files(root, ".kvb")[1]
    with open(victim, "r+b") as f:
        f.seek(header_size_for(16) - 7)
        f.write(b"\x04")
    (rep,) = maintenance.verify_cache(root, delete=False)
    assert (rep.checked, rep.ok, rep.bad) == (3, 2, {"padding": 1})


def test_prune_ttl_capacity_and_orphans(populated) -> None:
    cache_dir, _ = populated
    root = kv_root(cache_dir)
    alpha = sorted(files(root / "alpha-v2", ".kvb"))
    for p in [*alpha[:2], *files(root / "alpha-v0", ".kvb")]:
        os.utime(p, ns=(LONG_AGO, LONG_AGO))  # last access long ago
    rep = maintenance.prune_cache(root, ttl_s=86400)
    assert rep.ttl_removed == 3  # two expired alpha blocks and the old-format file (atime is format-free)
    assert rep.orphan_tmp_removed == 1 and not files(root, ".tmp")
    assert rep.namespaces_removed == ["alpha-v0"] and not (root / "alpha-v0").exists()
    assert rep.remaining_blocks == 7
    file_size = header_size_for(16) + SPEC.nbytes
    rep = maintenance.prune_cache(root, ttl_s=86400, capacity_bytes=5 * file_size)
    assert rep.capacity_removed >= 2 and rep.remaining_bytes <= 5 * file_size


def test_prune_takes_the_least_recently_used_leaves_across_namespaces(tmp_path, open_tier) -> None:
    """The tier's own eviction order over the whole root: a chain is cut at its tail, never
    orphaned, even where its root was accessed longest ago."""
    root = kv_root(tmp_path)
    alpha = open_tier(root, ns="alpha", async_writes=False)
    beta = open_tier(root, ns="beta", async_writes=False)
    linked = chain(4, linked=True)
    alpha.store(linked)
    alone = chain(2, seed=1)
    beta.store(alone)
    alpha.close(10)
    beta.close(10)
    by_key = {key_from_block_name(p.name): p for p in files(root, ".kvb")}
    second = 10**9
    # the chain accessed root first (root oldest); beta's blocks one older than its leaf, one newer
    for i, r in enumerate(linked):
        os.utime(by_key[r.key], ns=(LONG_AGO + i * second, LONG_AGO + i * second))
    os.utime(by_key[alone[0].key], ns=(LONG_AGO + 2 * second, LONG_AGO + 2 * second))
    os.utime(by_key[alone[1].key], ns=(LONG_AGO + 9 * second, LONG_AGO + 9 * second))
    file_size = header_size_for(16) + SPEC.nbytes
    rep = maintenance.prune_cache(root, ttl_s=10**10, capacity_bytes=4 * file_size)
    assert (rep.ttl_removed, rep.capacity_removed, rep.remaining_blocks) == (0, 2, 4)
    left = {key_from_block_name(p.name) for p in files(root, ".kvb")}
    assert left == {*(r.key for r in linked[:3]), alone[1].key}  # beta's older block, then alpha's leaf
    stats = {s.info.namespace: s for s in maintenance.cache_stats(root)}
    assert stats["alpha"].unreachable_blocks == 0
    rep = maintenance.prune_cache(root, ttl_s=0.0)  # everything expired: leaves, then their parents
    assert rep.ttl_removed == 4 and rep.remaining_blocks == 0 and not files(root, ".kvb")


def test_clear_lists_and_deletes(populated) -> None:
    cache_dir, _ = populated
    root = kv_root(cache_dir)
    rep = maintenance.clear_cache(root, ["beta"])
    assert [n["dir"] for n in rep.namespaces] == ["beta-v2"] and rep.namespaces[0]["blocks"] == 3
    assert not (root / "beta-v2").exists() and (root / "alpha-v2").exists()
    rep = maintenance.clear_cache(root)
    assert sorted(n["dir"] for n in rep.namespaces) == ["alpha-v0", "alpha-v2"]
    assert maintenance.list_namespaces(root) == []


def test_clear_deletes_the_outputs_suffix_drafts_from(populated, capsys) -> None:
    """What ``--speculative suffix`` kept of the outputs (token ids of what was generated) goes
    with the namespace's blocks: all of it on a plain clear, a namespace's on ``--namespace``."""
    cache_dir, _ = populated
    for ns in ("alpha", "beta"):
        kept = RecentOutputs(draft_outputs_path(cache_dir, ns))
        kept.add(b"root", [1, 2, 3, 4, 5])
        kept.close()
    assert _cli("cache", "clear", "--cache-dir", str(cache_dir), "--namespace", "beta") == 0
    assert "beta.outputs" in capsys.readouterr().out
    assert sorted(p.name for p in (cache_dir / "spec").iterdir()) == ["alpha.outputs"]
    assert _cli("cache", "clear", "--cache-dir", str(cache_dir), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["draft_outputs"] == [str(draft_outputs_path(cache_dir, "alpha"))]
    assert not list((cache_dir / "spec").iterdir())
    assert _cli("cache", "clear", "--cache-dir", str(cache_dir)) == 0
    assert "nothing to delete" in capsys.readouterr().out


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvcellar")
    add_cache_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_in_process(populated, capsys, monkeypatch) -> None:
    cache_dir, _ = populated
    monkeypatch.setenv("KVCELLAR_CACHE_DIR", str(cache_dir))  # no --cache-dir: the environment decides
    assert _cli("cache", "stats", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert {n["namespace"] for n in doc["namespaces"]} == {"alpha", "beta"}
    assert _cli("cache", "verify", "--keep") == 1  # bad block found, kept
    assert "checksum: 1" in capsys.readouterr().out
    assert _cli("cache", "verify") == 1 and _cli("cache", "verify") == 0
    capsys.readouterr()
    assert _cli("cache", "prune", "--ttl-days", "1", "--max-gb", "1") == 0
    assert "orphan temp" in capsys.readouterr().out
    assert _cli("cache", "clear", "--cache-dir", str(cache_dir)) == 0
    out = capsys.readouterr().out
    assert "alpha-v2" in out and "beta-v2" in out
    assert _cli("cache", "stats") == 0 and "(empty)" in capsys.readouterr().out
    assert _cli("cache", "verify", "--cache-dir", str(cache_dir / "missing")) == 2


def test_cli_in_a_real_process(populated) -> None:
    cache_dir, _ = populated
    code = ("import argparse, sys\n"
            "from kvcellar.storage.disk.cli import add_cache_commands\n"
            "p = argparse.ArgumentParser(prog='kvcellar')\n"
            "add_cache_commands(p.add_subparsers(dest='command', required=True))\n"
            "a = p.parse_args(sys.argv[1:])\n"
            "sys.exit(a.func(a))\n")
    r = subprocess.run([sys.executable, "-c", code, "cache", "stats", "--cache-dir", str(cache_dir)],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "alpha" in r.stdout and "weights=a" in r.stdout and "old format v0" in r.stdout
