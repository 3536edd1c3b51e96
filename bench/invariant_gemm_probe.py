"""The batch-invariant GEMM (kernels/triton_gemv.py, invariant=True) on the GPU: which
configs per Qwen3-8B product serve each row count best without changing a row's bits,
against the default path (the skinny kernel up to 16 rows, cuBLAS past).

    python bench/invariant_gemm_probe.py --out FILE [--rows 1,5,16,40,64,128,320,1040,4160]
        [--write-config kernels/invariant_gemm_configs.json]
    python bench/invariant_gemm_probe.py --picks-from FILE --write-config ...   # no GPU

Rows: 1 = a plain step at batch 1, 5 = a 4-node verify, 16 / 64 = plain steps at batch
16 / 64, 40 / 320 = 5-node trees at batch 8 / 64, 128 / 1040 = ~17-node trees at batch
8 / 64, 4160 = 64-node trees at batch 64. Per product and config: time at every
row count (a CUDA graph walking weight copies larger than L2, bench/gemv_probe.py's
graph_ms), whether a row gives the same bits alone and first, middle and last among
M rows at every M, and which configs give each other's bits (same_bits). The picks per
product (``buckets``): the configs invariant at every M that give the bits of the fastest
at one row; per row count the fastest of them, so M picks the config and no row's bits
move. --write-config merges the picks into the tuned file under this GPU's name (the
invariant backend reads it at import); --picks-from re-derives them from a saved --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from gemv_probe import SHAPES, graph_ms
from treespec.kernels import triton_backend, triton_gemv

# (BM, BN, BK, num_warps, num_stages); the 16-row class's tiles are tried as well
# (s42: past ~64 rows the picks lost 1.3-2 × to cuBLAS, so wider tiles and deeper pipelines
# were added for 64-1040 rows)
CANDIDATES = [(32, 64, 64, 4, 3), (64, 32, 64, 4, 4),
              (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3),
              (64, 128, 128, 8, 3), (64, 32, 256, 4, 4), (128, 64, 64, 4, 3),
              (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
              (64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]


def product(silu: bool, config=None, invariant: bool = True):
    if not invariant:
        return triton_backend.linear_silu_mul if silu else triton_backend.linear
    run = triton_gemv.linear_silu_mul if silu else triton_gemv.linear
    return lambda x, w: run(x, w, config, invariant=True)


def invariant_rows(run, x: torch.Tensor, w: torch.Tensor, rows: list[int]) -> bool:
    """Row 0 of x alone equals itself first, middle and last among m rows, every m."""
    alone = run(x[:1], w)[0]
    for m in rows:
        if m == 1:
            continue
        for at in (0, m // 2, m - 1):
            idx = torch.arange(1, m + 1, device=x.device) % x.shape[0]
            idx[at] = 0
            if not torch.equal(run(x[idx], w)[at], alone):
                return False
    return True


def buckets(entry: dict, rows: list[int]) -> list[list[int]]:
    """[max_rows, BM, BN, BK, warps, stages] per row count: the fastest config there among
    those that are invariant, accurate and give the bits of the fastest at one row (so
    any M may take any of them); consecutive equal configs merged."""
    ok = {cfg: c for cfg, c in entry["configs"].items()
          if c.get("invariant") and c.get("rel_err", 1) < 2e-2}
    if not ok:
        return []

    def ms(cfg: str, m: int) -> float:          # int keys in process, str from a file
        t = ok[cfg]["ms"]
        return t[m] if m in t else t[str(m)]
    anchor = min(ok, key=lambda cfg: ms(cfg, rows[0]))
    same = {frozenset(p) for p in entry["same_bits"]}
    cls = [cfg for cfg in ok if cfg == anchor or frozenset((cfg, anchor)) in same]
    out: list[list[int]] = []
    for m in rows:
        cfg = json.loads(min(cls, key=lambda c: ms(c, m)).replace("(", "[").replace(")", "]"))
        if out and out[-1][1:] == cfg:
            out[-1][0] = m
        else:
            out.append([m, *cfg])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--rows", default="1,5,16,40,64,128,320,1040,4160")
    ap.add_argument("--write-config", default="")
    ap.add_argument("--picks-from", default="",
                    help="a saved --out file: write its buckets to --write-config, no GPU")
    a = ap.parse_args()
    if a.picks_from:
        res = json.loads(Path(a.picks_from).read_text())
        picks = {f"{e['N'] // 2 if e['silu'] else e['N']},{e['K']},{int(e['silu'])}":
                 buckets(e, res["rows"]) for e in res["products"].values()}
        write_table(a.write_config, res["device"], {k: v for k, v in picks.items() if v},
                    res.get("arch", "sm_90"))       # runs before the arch was saved: H100s
        return
    if not a.out:
        ap.error("--out is required (unless --picks-from)")
    rows = [int(r) for r in a.rows.split(",")]
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    torch.manual_seed(0)
    res: dict = {"device": name, "arch": "sm_{}{}".format(*torch.cuda.get_device_capability(dev)),
                 "rows": rows, "products": {}}
    picks: dict[str, list[int]] = {}
    for pname, (n, k, silu) in SHAPES["8b"].items():
        copies = max(2, -(-600_000_000 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in rows}
        entry: dict = {"N": n, "K": k, "silu": silu, "default_ms": {}, "configs": {}}
        base = product(silu, invariant=False)
        for m in rows:
            entry["default_ms"][m] = graph_ms([lambda w=w, x=xs[m]: base(x, w) for w in ws])
        n_out = n // 2 if silu else n           # the kernel's output columns
        sixteen = (16, *triton_gemv.pick_config(n_out, k, silu, 16))
        outs: dict[str, torch.Tensor] = {}      # each config's rows, for bits across configs
        for cfg in [sixteen] + CANDIDATES:
            run = product(silu, cfg)
            try:
                outs[str(cfg)] = run(xs[rows[-1]][:64], ws[0])
                want = F.linear(xs[rows[-1]][:64].float(), ws[0].float())
                got = run(xs[rows[-1]][:64], ws[0]).float()
                if silu:
                    want = F.silu(want[:, :n // 2]) * want[:, n // 2:]
                err = ((got - want).norm() / want.norm()).item()
                c = {"rel_err": err, "invariant": invariant_rows(run, xs[rows[-1]], ws[0], rows),
                     "ms": {m: graph_ms([lambda w=w, x=xs[m]: run(x, w) for w in ws])
                            for m in rows}}
                c["worst_ratio"] = max(c["ms"][m] / entry["default_ms"][m] for m in rows)
            except Exception as e:          # a config that does not compile or fit
                c = {"error": repr(e)[:200]}
            entry["configs"][str(cfg)] = c
            print(f"{pname:8s} {cfg}: " + (c.get("error") or
                  f"inv {c['invariant']} err {c['rel_err']:.1e} worst x{c['worst_ratio']:.2f} "
                  + " ".join(f"{m}:{c['ms'][m] * 1000:.0f}us" for m in rows)), flush=True)
        # configs whose rows carry the same bits (one K order: these may share rows by M)
        entry["same_bits"] = [[a, b] for i, a in enumerate(outs) for b in list(outs)[i + 1:]
                              if torch.equal(outs[a], outs[b])]
        print(f"{pname:8s} same bits: {entry['same_bits']}", flush=True)
        got = buckets(entry, rows)
        if got:
            entry["pick"] = got
            picks[f"{n_out},{k},{int(silu)}"] = got
            print(f"{pname:8s} pick {got}; default "
                  + " ".join(f"{m}:{entry['default_ms'][m] * 1000:.0f}us" for m in rows),
                  flush=True)
        res["products"][pname] = entry
        res["picks"] = picks
        Path(a.out).write_text(json.dumps(res, indent=1))      # each product as it ends
        del ws, xs
        torch.cuda.empty_cache()
    if a.write_config and picks:
        write_table(a.write_config, name, picks, res["arch"])


def write_table(path_s: str, device: str, picks: dict, arch: str) -> None:
    """picks under the GPU's name; the first GPU tuned of an architecture also serves the
    others of it (arch, e.g. sm_90, names it)."""
    path = Path(path_s)
    table = json.loads(path.read_text()) if path.exists() else {}
    table[device] = {**table.get(device, {}), **picks}
    table.setdefault(arch, device)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
