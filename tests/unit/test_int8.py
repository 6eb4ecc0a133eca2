"""int8.release drops a finished tensor's pages of a mapped safetensors file, and only those."""

import torch
from safetensors.torch import load_file, save_file

from sparklm.infer.int8 import file_mappings, in_mappings, release


def _resident_kb(path) -> int:
    """This process's resident kB of its mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_release_drops_a_mapped_tensors_pages_and_keeps_its_neighbours(tmp_path):
    path = tmp_path / "w.safetensors"
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)  # 4 MiB each
    save_file({"a": a, "b": b}, str(path))
    loaded = load_file(str(path))  # safetensors maps the file: its tensors are views of the mapping
    assert in_mappings(loaded["a"], file_mappings()) and not in_mappings(a, file_mappings())
    assert float(loaded["a"].sum()) == float(a.sum()) and float(loaded["b"].sum()) == float(b.sum())  # read: resident
    before = _resident_kb(path)
    assert before >= 8 * 1024 - 8
    release(loaded["a"])
    after = _resident_kb(path)
    assert before - 4 * 1024 - 8 <= after <= before - 4 * 1024 + 8  # a's whole pages gone, b's kept
    assert torch.equal(loaded["b"], b)
    assert torch.equal(loaded["a"], a)  # clean file pages: read from the file again, unchanged


def test_shares_bytes_finds_a_tied_head_and_overlapping_views_only():
    from sparklm.infer.int8 import shares_bytes

    embedding = torch.nn.Embedding(64, 16)
    head = torch.nn.Linear(16, 64, bias=False)
    head.weight = embedding.weight  # tied, as most small LMs are
    assert shares_bytes(head.weight, [embedding.weight])
    whole = torch.zeros(8, 1024)
    assert shares_bytes(whole[2:4], [whole[3:6]]) and not shares_bytes(whole[2:4], [whole[4:6], torch.zeros(3)])
    assert not shares_bytes(whole[2:4], [whole[4:4]])  # an empty view holds no bytes
