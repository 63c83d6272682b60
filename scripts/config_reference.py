#!/usr/bin/env python3
"""Write docs/configuration.md from the declaration of the settings
(src/fedagent/config/settings.py). Run from the project root after changing a setting;
tests/project/test_config_reference.py fails until the page is written again."""

from __future__ import annotations

import sys
from pathlib import Path

from fedagent.config.reference import page

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main() -> int:
    text = page()
    if PAGE.exists() and PAGE.read_text() == text:
        print(f"{PAGE} is up to date")
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
