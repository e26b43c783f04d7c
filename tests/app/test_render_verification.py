"""The app and notebook view mark a verifier's corrections apart from the tokens each model wrote."""
from __future__ import annotations

import math

from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.service.output import render_html


def test_corrections_are_outlined_and_named_in_the_legend_and_the_hover():
    records = [TokenRecord(1, "a", "small", math.nan, 0.1, verified=True),
               TokenRecord(2, "b", "large", math.nan, 0.2, correction=True),
               TokenRecord(3, "c", "large", math.nan, 0.3)]
    page = render_html(records, ["small", "large"])
    assert page.count("tr-correction") == 1 and ">correction</span>" in page
    assert "title='small · verified" in page and "title='large · correction" in page
    assert "title='large · score" in page  # a plain large token says neither
    assert "correction" not in render_html(records[2:], ["small", "large"])


def test_tolerated_drafts_are_marked_apart_from_plain_verified_ones():
    records = [TokenRecord(1, "a", "small", math.nan, 0.1, verified=True, tolerated=True),
               TokenRecord(2, "b", "small", math.nan, 0.2, verified=True)]
    page = render_html(records, ["small", "large"])
    assert page.count("tr-tolerated") == 1 and ">tolerated</span>" in page
    assert "title='small · tolerated" in page and "title='small · verified ·" in page
    assert "tolerated" not in render_html(records[1:], ["small", "large"])
