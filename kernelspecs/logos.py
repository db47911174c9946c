"""Draw each shipped kernelspec's logo: ``logo-svg.svg``, and ``logo-32x32.png`` and
``logo-64x64.png`` rendered from it.

A shield, the sandbox, on a colour of its own per kernelspec, holding what the kernel is
for: Python's two interlocking blocks, or a bar chart for data science. In the Launcher
and the kernel menus they tell the sandboxed kernels apart from each other and from a
local Python (whose logo is Python's own). The files are committed; run this after a
change (it needs cairosvg, from PyPI: ``pip install cairosvg``)::

    python kernelspecs/logos.py
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

SHIELD = "M32 7 L53 14.5 V30 C53 43.5 44 52 32 57.5 C20 52 11 43.5 11 30 V14.5 Z"

#: Python's two blocks, small, inside the shield.
PYTHON = """
  <path d="M31.5 17 h-5 a5 5 0 0 0 -5 5 v4 h10.5 v2 h-14 a4 4 0 0 0 -4 4 v3 a4 4 0 0 0 4 4 h3 v-4
    a4 4 0 0 1 4 -4 h9 a4 4 0 0 0 4 -4 v-6 a4 4 0 0 0 -4 -4 z" fill="#3776ab"/>
  <circle cx="26.5" cy="21.5" r="1.6" fill="#ffffff"/>
  <path d="M32.5 49 h5 a5 5 0 0 0 5 -5 v-4 h-10.5 v-2 h14 a4 4 0 0 0 4 -4 v-3 a4 4 0 0 0 -4 -4 h-3
    v4 a4 4 0 0 1 -4 4 h-9 a4 4 0 0 0 -4 4 v6 a4 4 0 0 0 4 4 z" fill="#ffd43b"/>
  <circle cx="37.5" cy="44.5" r="1.6" fill="#ffffff"/>
"""

#: A bar chart and its axis.
CHART = """
  <rect x="19" y="33" width="6" height="12" rx="1" fill="#f28e2b"/>
  <rect x="29" y="24" width="6" height="21" rx="1" fill="#1f77b4"/>
  <rect x="39" y="29" width="6" height="16" rx="1" fill="#59a14f"/>
  <rect x="16" y="46" width="32" height="2.4" rx="1.2" fill="#334155"/>
"""

LOGOS = {
    "sandboxed-python": ("#1e4f8a", PYTHON),
    "sandboxed-python-datascience": ("#6b3fa0", CHART),
}


def svg(background: str, inside: str) -> str:
    """The logo: ``inside`` in a white shield on ``background``."""
    return f"""<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64">
  <rect x="1" y="1" width="62" height="62" rx="12" fill="{background}"/>
  <path d="{SHIELD}" fill="#ffffff"/>
{inside.strip()}
</svg>
"""


def main() -> None:
    import cairosvg

    for name, (background, inside) in LOGOS.items():
        folder = HERE / name
        text = svg(background, inside)
        (folder / "logo-svg.svg").write_text(text)
        for size in (32, 64):
            out = folder / f"logo-{size}x{size}.png"
            cairosvg.svg2png(bytestring=text.encode(), write_to=str(out), output_width=size, output_height=size)
        print(f"{name}: logo-svg.svg, logo-32x32.png, logo-64x64.png")


if __name__ == "__main__":
    main()
