"""Schemathesis over a running server's own OpenAPI schema, counting what it finds.

Every documented operation gets ``max_examples`` generated requests (valid and invalid
bodies, headers, paths). Each response must not be a 5xx and must match the schema (status
code, content type, body); after each case ``after_each`` (a normal request) must succeed, so
a case that broke the server is caught at once. Used by the test suite (a few examples) and by
``benchmarks/fuzz_server.py`` (thousands).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

REQUEST_TIMEOUT_S = 60  # a case that takes longer counts as a hang


@dataclass
class FuzzReport:
    cases: int = 0
    server_errors: int = 0  # responses with status >= 500
    failures: list[str] = field(default_factory=list)  # every failed check, and every broken after_each
    by_status: dict[int, int] = field(default_factory=dict)


def fuzz_openapi(schema_url: str, max_examples: int, model: str | None = None,
                 after_each: Callable[[], None] | None = None, seed: int | None = None,
                 on_case: Callable[[], None] | None = None) -> FuzzReport:
    """Fuzz every operation of the schema at ``schema_url``; ``seed`` None derandomizes (the
    same cases every run, for tests). ``model``: the served model's name, put into most
    generated bodies (a random name is a 404 before anything else is looked at)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(schema_url)
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(), served_model=st.integers(0, 3).map(bool))
        @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=seed is None, database=None)
        def check(case, served_model):
            report.cases += 1
            if model is not None and served_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model
            if on_case is not None:
                on_case()
            try:
                response = case.call(timeout=REQUEST_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a hang or a dropped connection is a finding
                report.failures.append(f"{operation.label}: no response: {e!r}")
                return
            report.by_status[response.status_code] = report.by_status.get(response.status_code, 0) + 1
            report.server_errors += response.status_code >= 500
            try:
                case.validate_response(response, checks=checks)
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - recorded; the run goes on
                report.failures.append(f"{operation.label}: {str(e)[:2000]}")
            if after_each is not None:
                try:
                    after_each()
                except Exception as e:  # noqa: BLE001
                    report.failures.append(f"{operation.label}: the next normal request failed: {e!r}")

        if seed is not None:
            from hypothesis import seed as hypothesis_seed

            check = hypothesis_seed(seed)(check)
        check()
    return report
