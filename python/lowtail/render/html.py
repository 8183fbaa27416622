"""HTML reports from the Jinja2 templates in ``lowtail/render/templates`` (the repository's top-level
``templates/`` is a link to it, as ``module_utils/lowtail`` links to ``lowtail/node``: what the wheel ships
is what the repository shows). Autoescaped: a hostname or an error message is text, never markup.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lowtail import __version__

if TYPE_CHECKING:
    import jinja2


@dataclass
class Image:
    alt: str
    png: bytes

    @property
    def src(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    heading: str
    text: str = ""
    table: Table | None = None
    images: list[Image] = field(default_factory=list)


def environment() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("lowtail.render", "templates"),
        autoescape=True,  # every template is HTML; select_autoescape would miss the .j2 suffix
        undefined=jinja2.StrictUndefined,  # a misspelt field is an error, not an empty cell
        keep_trailing_newline=True,
    )


def render(template: str, **context: Any) -> str:
    """``template`` rendered with ``context``; every page's footer names the lowtail version."""
    return environment().get_template(template).render({"footer": f"lowtail {__version__}", **context})


def report(title: str, sections: list[Section], summary: list[str] | None = None, data: Any = None) -> str:
    """The standard report page: summary lines, sections (text, table, images), the JSON last."""
    return render(
        "report.html.j2",
        title=title,
        summary=summary or [],
        sections=sections,
        data=data,
    )
