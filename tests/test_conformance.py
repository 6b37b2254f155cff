"""The OpInfo conformance runner on the fixed CI subset (ops models use most)."""

import json

from torchneuron.eval import conformance


def test_ci_subset_passes(tmp_path):
    assert len(set(conformance.CI_OPS)) >= 60
    report = tmp_path / "conformance.json"
    results = conformance.run(
        ops=conformance.CI_OPS, dtypes=("float32",), max_samples=2, json_path=str(report), progress=False
    )
    by_status = {}
    for r in results:
        by_status.setdefault(r["status"], []).append(r["op"])
    assert not by_status.get("fail"), [r for r in results if r["status"] == "fail"]
    judged = len(results) - len(by_status.get("skipped", []))
    assert judged >= 60
    assert len(by_status.get("compiled-pass", [])) >= 0.9 * judged
    # The JSON report is written as it goes and the Markdown report renders.
    assert len(json.loads(report.read_text())["results"]) == len(results)
    md = tmp_path / "conformance.md"
    conformance.write_markdown(str(md), results, "pytest", 2)
    assert "| float32 |" in md.read_text()


def test_resume_skips_done_ops_and_records_a_crash(tmp_path):
    report = tmp_path / "c.json"
    first = conformance.run(ops=["abs"], max_samples=1, json_path=str(report), progress=False)
    assert [r["status"] for r in first] == ["compiled-pass"]
    # A run that died inside "neg" left its marker behind.
    (tmp_path / "c.json.current").write_text("neg\tfloat32")
    again = conformance.run(ops=["abs", "neg"], max_samples=1, json_path=str(report), resume=True, progress=False)
    status = {r["op"]: r for r in again}
    assert status["abs"]["seconds"] == first[0]["seconds"]  # kept, not rerun
    assert status["neg"]["status"] == "fail" and "crashed" in status["neg"]["error"]
