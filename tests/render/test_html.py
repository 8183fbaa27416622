"""HTML reports come from the Jinja2 templates in templates/ (the package's lowtail/render/templates),
autoescaped: a value is text, never markup."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import jinja2
import pytest

from lowtail.render import html

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def test_values_are_escaped_not_interpreted() -> None:
    page = html.report(
        "host <script>alert(1)</script>",
        [html.Section("s", text="a < b & c", table=html.Table(["k"], [["<b>x</b>"]]))],
        data={"err": "</pre><script>"},
    )
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a &lt; b &amp; c" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page


def test_images_are_embedded_as_the_png_bytes() -> None:
    page = html.report("t", [html.Section("s", images=[html.Image("plot", PNG)])])
    (src,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert base64.b64decode(src) == PNG


def test_a_misspelt_template_field_is_an_error_not_an_empty_cell() -> None:
    env = html.environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ hostnme }}").render(hostname="x")


def test_top_level_templates_is_what_the_package_ships() -> None:
    # One set of templates: the repository's templates/ is the package's lowtail/render/templates.
    shipped = Path(html.__file__).parent / "templates"
    assert (ROOT / "templates").resolve() == shipped.resolve()
    assert sorted(p.name for p in shipped.glob("*.j2")) == sorted(html.environment().list_templates())
