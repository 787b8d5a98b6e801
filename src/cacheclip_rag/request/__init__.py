"""The request path, one module per stage, in the order a request runs through them:

    options.py         RequestOptions (validated per-request options) and the frozen `Request`
    prepare.py         Preparer: question / prompt / chat -> `Prepared` (context.py), the selector
                       looked up once, the selection settings from profile_source.py
    selector.py        the `Selector` protocol and registry; plan.py: the `Plan` a selector returns
    execute.py         plan (on the aux thread where it overlaps) while assemble.py + pipeline.py
                       load and re-rotate the chunk caches layer by layer; recompute.py recomputes
                       the plan's rows in place -> `Executed` (logits, rows, timings, trace)
    decode.py          the token loop after the first logits
    answer.py          `AnswerStream` / `Answer`: runs the stages and reports what was reused
"""
