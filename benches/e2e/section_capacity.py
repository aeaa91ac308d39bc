"""Section for the "capacity" scenario (N = 64, 0 ms, closed loop); see report_common for the contract."""

from report_common import NOISE_RATE, best, by_subject, compare, fmt, markdown_table
from section_closed import HEAD, cases, table_rows

TITLE = "Capacity: N = 64, fast upstream, the proxy is the bottleneck"


def render(runs, meta):
    lines = ["wrk closed loop against the 0 ms upstream with a cap of 64: what each proxy can push through itself."]
    for cap, delay, clients in cases(runs):
        key = lambda r, c=cap, k=clients: (r["cap"], r["clients"]) == (c, k)
        lines += ["", f"### N = {cap}, {clients} clients, {delay} ms", ""]
        lines += markdown_table(HEAD, table_rows(runs, key))
    return lines


def targets(runs, meta):
    out = []
    for layout in ("shared", "pinned"):
        rbs = by_subject([r for r in runs if r["layout"] == layout])
        fs, fv = best(rbs, "floodgate", lambda r: r["ok_rate"])
        hs, hv = best(rbs, "haproxy", lambda r: r["ok_rate"])
        if fv is None:
            continue
        out.append({
            "target": f"Capacity, N = 64, 0 ms ({layout} CPUs): 2xx/s >= HAProxy's",
            "floodgate": f"{fs}: {fmt(fv)}",
            "peer": f"{hs}: {fmt(hv)}" if hv is not None else "-",
            "verdict": compare(fv, hv, True, NOISE_RATE),
            "note": f"ratio {fv / hv:.2f}" if hv else "",
        })
    return out
