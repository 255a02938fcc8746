"""Interval arithmetic on GPU timelines, shared by the profiling skills' scripts (capture-profile,
analyze-nsys-profile). A script imports it with `sys.path.insert(0, <skills>/_common)`; the skills
are scripts, not a package. Times are in any one unit (the caller's)."""


def merged(spans):
    """Sorted (start, end) spans -> their union as disjoint sorted spans."""
    out = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap_time(spans, cover):
    """Total time of `spans` covered by `cover`, both sorted and disjoint (merged()); one pass."""
    total, j = 0.0, 0
    for a, b in spans:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def gaps(busy, min_len):
    """The idle (start, end) spans of at least `min_len` between the merged `busy` spans."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_len]


COLLECTIVES = ("all-to-all/p2p", "all-gather", "reduce-scatter", "all-reduce", "other")


def collective(name: str) -> str | None:
    """The kind of an NCCL kernel (all_to_all_single and pipeline send/recv run as SendRecv);
    None for a kernel that is not NCCL's."""
    low = name.lower()
    if "nccl" not in low:
        return None
    for key, kind in (("sendrecv", "all-to-all/p2p"), ("allgather", "all-gather"),
                      ("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce")):
        if key in low:
            return kind
    return "other"


def verdict(failures: list[str], passed: str = "") -> int:
    """Print the last line every skill script ends with: PASS and what was checked (`passed`), or FAIL with the
    reasons; the exit status."""
    print((f"PASS: {passed}" if passed else "PASS") if not failures else f"FAIL: {'; '.join(failures)}")
    return 1 if failures else 0
