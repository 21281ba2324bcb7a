"""Gather the benchmark sections in docs/bench/*.md into docs/benchmarks.md.

Each benchmark script writes its own section (with the machine and date of its run); this keeps
them in one document, in a fixed order, with a table of contents. Results recorded by hand go in a
file of their own here too (`*_notes.md`): text added to docs/benchmarks.md itself is lost at the
next collection.
Usage: python benchmarks/collect.py
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["sim", "sim_speed_notes", "elastic", "elastic_notes", "gpu_models", "gpu_models_notes", "parallel", "decisions", "decisions_mixed", "packing", "prefect", "demo_db", "predictor",
         "pairs_synthetic", "learned_sim", "store_growth", "fairness", "infra", "infra_notes", "k8s_nodes", "k8s_nodes_notes", "k8s_pod_usage", "soak_notes"]
TITLES = {
    "sim": "Simulator fidelity and qosflow's policy (issues 2, 3)",
    "sim_speed_notes": "qosflow's simulation speed: side runs written by hand (issue 2)",
    "elastic": "Elastic starts on fewer GPUs (issue 3, beyond its targets)",
    "elastic_notes": "Elastic starts: verdict (recorded by hand)",
    "gpu_models": "Mixed GPU models: V100 + P100 + K80 clusters (issue 3, beyond its targets)",
    "gpu_models_notes": "Mixed GPU models: side runs (recorded by hand)",
    "parallel": "Runs in worker processes (simulate, pack)",
    "decisions": "Placement decision rate (issues 2, 3)",
    "decisions_mixed": "Placement decision rate on a cluster of mixed GPU models",
    "packing": "GPU-sharing packing on the Alibaba trace (issues 2, 3)",
    "prefect": "Prefect integration (issue 5)",
    "demo_db": "The demo on SQLite and on PostgreSQL (issue 5)",
    "predictor": "Predictor accuracy and speed (issue 4)",
    "pairs_synthetic": "Pair-table model on synthetic co-location tables (issue 4, generality)",
    "learned_sim": "Learned estimates in the simulator (issue 4)",
    "store_growth": "The predictor's store: growth and retention (issue 4)",
    "fairness": "Fairness between users (qosflow's fair_share)",
    "infra": "Infrastructure: agents and Kubernetes (issue 6)",
    "infra_notes": "Progress copies from agent hosts (issue 6, recorded by hand)",
    "k8s_nodes": "Kubernetes node tracking: a watch instead of a LIST per heartbeat",
    "k8s_nodes_notes": "Kubernetes node tracking: notes (recorded by hand)",
    "k8s_pod_usage": "Kubernetes: reading the pods that are not qosflow's",
    "soak_notes": "Soak: the worker under a continuous stream of small pipelines (recorded by hand)",
}


def main() -> None:
    bench = ROOT / "docs" / "bench"
    files = {p.stem: p for p in bench.glob("*.md") if p.stem.upper() != "CONVENTIONS"}
    names = [n for n in ORDER if n in files] + sorted(n for n in files if n not in ORDER)
    out = [
        "# Benchmarks",
        "",
        "Every figure below comes from a script in `benchmarks/`, run on the machine named in its section "
        "(shared, 2 cores: compare the ratios within one run, not absolute times across runs). "
        "Regenerate a section with its script's `--write` flag, then `python benchmarks/collect.py`.",
        "",
    ]
    out += [f"- [{TITLES.get(n, n)}](#{n.replace('_', '-')})" for n in names]
    for n in names:
        out += ["", f'<a id="{n.replace("_", "-")}"></a>', "", files[n].read_text().rstrip()]
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(out) + "\n")
    print("wrote docs/benchmarks.md from", ", ".join(names))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # (--help)
    main()
