"""``python -m dsv4_attn.bench ncu-roles``: cutting an ncu source page into the decode kernel's
warp roles."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest

from dsv4_attn.bench import ncu_roles

HEADER = [
    "Address",
    "Source",
    ncu_roles.SAMPLES,
    ncu_roles.EXECUTED,
    "stall_barrier",
    "stall_wait",
    "stall_barrier (Not Issued)",
]

# (SASS, samples, executed, barrier stalls, wait stalls): a prologue, then the producer (lowers
# its registers), WG1 (PV only) and WG0 (the 64 x 32 QK wgmmas) in the order ptxas laid them out
# in the profiled kernel.
ROWS = [
    ("LDC R1, c[0x0][0x28]", 4, 3072, 0, 1),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 1024, 0, 0),
    ("PRMT R8, R12, 0x1404, RZ", 20, 20480, 0, 15),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 1024, 0, 0),
    ("LDS R3, [R2+0x128]", 30, 20480, 27, 0),
    ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4].tnspB, R24, gsb0", 10, 10240, 0, 0),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 1024, 0, 0),
    ("HGMMA.64x32x16.F32.BF16 R152, R32, gdesc[UR8], R152", 6, 10240, 0, 6),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 10240, 30, 0),
]


def write_page(path: Path, rows) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "kernel_cutlass_kernel_test"])
        out.writerow(HEADER)
        for i, (sass, samples, executed, barrier, wait) in enumerate(rows):
            out.writerow([hex(16 * i), f"      {sass}", samples, executed, barrier, wait, barrier])


@pytest.mark.parametrize("name", ["page.csv", "page.csv.gz"])
def test_roles_are_cut_at_setmaxnreg_and_told_apart_by_their_work(tmp_path, name):
    path = tmp_path / name
    write_page(path, ROWS)
    result = ncu_roles.summarize(path, top=2)
    roles = result["roles"]
    assert result["samples"] == 100
    assert {r: round(v["share"], 2) for r, v in roles.items()} == {
        "prologue": 0.04,
        "producer": 0.20,
        "WG1": 0.40,
        "WG0": 0.36,
    }
    # stall reasons are shares of the role's own samples
    assert roles["WG1"]["stalls"] == {"barrier": 27 / 40}
    assert roles["WG0"]["stalls"] == {"barrier": 30 / 36, "wait": 6 / 36}
    hot = roles["WG0"]["hot"]
    assert [h["sass"] for h in hot] == [ROWS[7][0], ROWS[8][0]]  # in code order
    assert hot[1]["reason"] == "barrier" and hot[1]["executed"] == 10240


def test_a_page_without_the_three_roles_is_refused(tmp_path):
    path = tmp_path / "page.csv"
    write_page(path, [r for r in ROWS if "DEALLOC" not in r[0]])
    with pytest.raises(ValueError, match="3 setmaxnreg"):
        ncu_roles.summarize(path, top=2)
    write_page(path, [r if "64x32" not in r[0] else ("FADD R1, R2, R3", *r[1:]) for r in ROWS])
    with pytest.raises(ValueError, match="could not tell the roles apart"):
        ncu_roles.summarize(path, top=2)


def test_the_subcommand_prints_the_roles_and_writes_json(tmp_path, capsys):
    import json

    from dsv4_attn.bench import main

    page, out = tmp_path / "page.csv", tmp_path / "roles.json"
    write_page(page, ROWS)
    main(["ncu-roles", str(page), "--top", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "100 samples" in printed and "WG0" in printed and "producer" in printed
    assert json.loads(out.read_text())["roles"]["WG1"]["share"] == 0.4
