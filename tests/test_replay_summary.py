"""Replay summary math on known records (mooncaked.replay.summary, report)."""

import orjson
import pytest

from mooncaked.replay import RequestRecord, summarize
from mooncaked.replay.report import write_json, write_plots
from mooncaked.replay.runner import is_slo_refusal


def done(index, sent, ttft, gaps, prompt, cached, end=None):
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    from mooncaked.measures import tbt_s
    return RequestRecord(index=index, scheduled_s=sent, sent_prompt_tokens=prompt,
                         max_tokens=len(times), sent_s=sent, end_s=end or sent + times[-1],
                         status=200, ok=True, ttft_s=ttft, tbt_s=tbt_s(times),
                         token_times_s=times, prompt_tokens=prompt, cached_tokens=cached,
                         output_tokens=len(times))


def records():
    return [
        # TBT = longest gap of 5 gaps (ceil(10%) = 1) = 0.15
        done(0, 0.0, 1.0, [0.05, 0.05, 0.15, 0.05, 0.05], prompt=100, cached=0, end=2.0),
        # TBT 0.25
        done(1, 1.0, 2.0, [0.25, 0.05], prompt=100, cached=50, end=4.0),
        # TTFT 40 s misses the 30 s threshold; TBT 0.05
        done(2, 1.0, 40.0, [0.05], prompt=200, cached=150, end=41.0),
        RequestRecord(index=3, scheduled_s=2.0, sent_prompt_tokens=100, max_tokens=5, sent_s=2.0,
                      end_s=2.1, status=429, rejected=True, error="HTTP 429: busy",
                      retry_after="1", prompt_tokens=100, output_tokens=0),
        RequestRecord(index=4, scheduled_s=3.0, sent_prompt_tokens=100, max_tokens=5, sent_s=3.0,
                      end_s=3.5, status=500, error="HTTP 500: boom", prompt_tokens=100,
                      output_tokens=0),
    ]


def test_summary_values():
    s = summarize(records(), wall_s=41.5, ttft_slo_s=30.0, tbt_slos_s=(0.1, 0.2, 0.3))
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (5, 3, 1, 1)
    assert s["ttft_mean_s"] == pytest.approx(43.0 / 3)
    assert s["ttft_p50_s"] == pytest.approx(2.0)
    assert s["ttft_p90_s"] == pytest.approx(2.0 + 0.8 * 38.0)
    assert s["tbt_mean_s"] == pytest.approx((0.15 + 0.25 + 0.05) / 3)
    # Hit rate over completed requests only: (0 + 50 + 150) / 400.
    assert s["cache_hit_rate"] == pytest.approx(0.5)
    assert (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (400, 200, 11)
    assert s["duration_s"] == pytest.approx(41.0)
    assert s["output_throughput_tok_s"] == pytest.approx(11 / 41.0)
    # Misses: request 2 (TTFT), 3 (rejected), 4 (error); TBT decides 0 and 1.
    assert s["effective_request_capacity"] == {"0.1": pytest.approx(0 / 5),
                                               "0.2": pytest.approx(1 / 5),
                                               "0.3": pytest.approx(2 / 5)}


def test_summary_without_cache_reports_and_nothing_completed():
    recs = records()
    for r in recs:
        r.cached_tokens = None
    assert summarize(recs, 1.0)["cache_hit_rate"] is None
    s = summarize(recs[3:], 1.0)
    assert s["completed"] == 0 and s["ttft_mean_s"] is None and s["ttft_p90_s"] is None
    assert s["effective_request_capacity"]["0.1"] == 0.0
    orjson.dumps(s)  # JSON-ready: no NaN, no custom types


def test_json_and_plots_written(tmp_path):
    recs = records()
    s = summarize(recs, 41.5)
    path = write_json(tmp_path / "out", {"url": "x"}, s, recs)
    doc = orjson.loads(path.read_bytes())
    assert doc["summary"]["completed"] == 3
    assert [r["index"] for r in doc["requests"]] == [0, 1, 2, 3, 4]
    assert doc["requests"][3]["rejected"] is True and doc["requests"][3]["retry_after"] == "1"
    assert len(doc["requests"][0]["token_times_s"]) == 6
    pngs = write_plots(tmp_path / "out", recs, 30.0, (0.1, 0.2))
    assert [p.name for p in pngs] == ["ttft_cdf.png", "tbt_cdf.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_count_too_long():
    from mooncaked.replay import ReplayConfig, TraceRequest
    from mooncaked.replay.bench import count_too_long

    reqs = [TraceRequest(0, 0.0, 6400, 640, (0,)), TraceRequest(1, 0.0, 64, 64, (1,)),
            TraceRequest(2, 0.0, 99999, 64, (), "text is not counted")]
    cfg = ReplayConfig(url="http://x", model="m", length_scale=64)
    assert count_too_long(cfg, reqs, 105) == 1  # 100 + 10 > 105; 1 + 1 fits
    assert count_too_long(cfg, reqs, None) == 0
    cfg.max_output_tokens = 5
    assert count_too_long(cfg, reqs, 105) == 0


def test_an_slo_refusal_is_a_rejection_not_a_failure():
    """A 429 and a 400 slo_unattainable (over the TTFT SLO even when idle) are the
    conductor's early rejections; any other 400 is a failure."""
    unattainable = orjson.dumps({"error": {"message": "cannot meet the TTFT SLO", "type":
                                           "invalid_request_error", "param": "prompt",
                                           "code": "slo_unattainable"}})
    other = orjson.dumps({"error": {"message": "bad", "type": "invalid_request_error",
                                    "param": "prompt", "code": "invalid_value"}})
    assert is_slo_refusal(429, b"busy")
    assert is_slo_refusal(400, unattainable)
    assert not is_slo_refusal(400, other)
    assert not is_slo_refusal(400, b"not json") and not is_slo_refusal(400, b"[1]")
    assert not is_slo_refusal(500, unattainable)
