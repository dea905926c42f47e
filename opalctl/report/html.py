"""The page's HTML: escaping, a few elements, numbers with the value they show, and the document around them.

The document is offline by construction: its content security policy allows nothing to be fetched (no script,
no font, no frame, no connection; styles and images only inline), and nothing in it names another file. Every
number that comes from ``compare`` is shown with its exact value in ``data-value`` (``repr`` of the float), so a
test and a reader's script can check the page against ``opalctl compare --json``.
"""

from __future__ import annotations

from html import escape
from typing import Any

POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1040px; color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #1b7f3b; } .bad { color: #c0392b; font-weight: bold; } .muted { color: #777; }
pre { background: #f6f6f6; padding: 0.5em; white-space: pre-wrap; overflow-wrap: anywhere; font-size: 0.85em; }
figure { margin: 0.8em 0; } figure svg { max-width: 100%; height: auto; }
details.kept > summary { cursor: pointer; color: #555; margin: 0.4em 0; }
"""


def text(value: Any) -> str:
    return escape("" if value is None else str(value))


def shown_number(value: Any) -> str:
    """How a number reads on the page: an integer whole, anything else to four significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return text(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value)}"
    return f"{value:.4g}"


def number_cell(value: Any, **data: Any) -> str:
    """A table cell holding a number, with its exact value and what it is (``data-arm``, ``data-metric``...)."""
    attributes = "".join(f' data-{key.replace("_", "-")}="{text(v)}"' for key, v in data.items())
    exact = "" if value is None else f' data-value="{value!r}"'
    return f'<td class="n"{attributes}{exact}>{shown_number(value)}</td>'


def table(columns: list[str], rows: list[list[str]], cells_ready: bool = False) -> str:
    """A table; each cell escaped, unless ``cells_ready`` (then each is a ``<td>`` already)."""
    head = "".join(f"<th>{text(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cell if cells_ready else f"<td>{text(cell)}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def section(title: str, *parts: str, anchor: str = "") -> str:
    identity = f' id="{text(anchor)}"' if anchor else ""
    return f"<section{identity}><h2>{text(title)}</h2>{''.join(parts)}</section>"


def figure(svg: str, caption: str, name: str = "") -> str:
    """A figure with its caption; ``name`` (``data-figure``) says which one it is, for a reader's script."""
    named = f' data-figure="{text(name)}"' if name else ""
    return f"<figure{named}>{svg}<figcaption class=\"muted\">{text(caption)}</figcaption></figure>"


def paragraphs(sentences: list[str], css: str = "") -> str:
    style = f' class="{css}"' if css else ""
    return "".join(f"<p{style}>{text(s)}</p>" for s in sentences)


def document(title: str, *sections: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{POLICY}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{text(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{text(title)}</h1>{''.join(sections)}</body></html>\n")
