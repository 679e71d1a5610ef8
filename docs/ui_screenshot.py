"""Screenshots of the live view (/ui) of examples/map_reduce_summarization.py, for the docs.

    parrot serve                                  # in another terminal
    python docs/ui_screenshot.py [--url http://127.0.0.1:9000]

Runs the example against the server, opens the /ui link it prints in headless Chromium (Debian's
`chromium`, driven by Playwright: `pip install playwright`; no browser is downloaded), and saves
docs/ui-map-reduce-running.png (the first moment a call runs) and docs/ui-map-reduce.png (every call
done, a map call selected).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--chromium", default=os.environ.get("PARROT_CHROMIUM") or shutil.which("chromium"))
    args = parser.parse_args()
    if not args.chromium:
        sys.exit("no chromium found: apt-get install chromium (or pass --chromium PATH)")
    app = subprocess.Popen([sys.executable, str(ROOT / "examples/map_reduce_summarization.py"), "--url", args.url,
                            "--keep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        link = None
        for line in app.stdout:
            print(line, end="")
            m = re.search(r"(http\S+/ui#\S+)", line)
            if m:
                link = m.group(1)
                break
        if link is None:
            sys.exit("the example printed no /ui link")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1680, "height": 660}, device_scale_factor=1)
            page.goto(link)
            page.wait_for_selector("#graph g.node.call[data-state='running']", timeout=600_000)
            time.sleep(0.3)
            page.screenshot(path=str(args.out / "ui-map-reduce-running.png"))
            page.wait_for_function(
                "[...document.querySelectorAll('#graph g.node.call')].every(n => n.dataset.state === 'done')",
                timeout=900_000)
            page.locator("#graph g.node.call").nth(1).click()
            time.sleep(0.3)
            page.screenshot(path=str(args.out / "ui-map-reduce.png"))
            browser.close()
        for line in app.stdout:  # the rest of the app's output, up to its "press Enter"
            print(line, end="")
            if "press Enter" in line:
                break
        app.stdin.write("\n")
        app.stdin.flush()
        app.wait(60)
    finally:
        if app.poll() is None:
            app.kill()


if __name__ == "__main__":
    main()
