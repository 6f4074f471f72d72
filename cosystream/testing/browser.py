"""Headless Chromium from the system's packages (Debian: chromium, chromium-driver) through Selenium, for
the playground's browser tests and its benchmark. Nothing is downloaded: Selenium is given both the
browser and the driver, so its driver manager never runs.

    with chromium(tmp_dir) as driver:
        driver.get("http://127.0.0.1:8000/")
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM_ENV, CHROMEDRIVER_ENV = "COSYSTREAM_CHROMIUM", "COSYSTREAM_CHROMEDRIVER"
INSTALL_HINT = "apt-get install chromium chromium-driver; pip install selenium"
# Headless, no network beyond the page, and the fake microphone/camera with autoplay allowed, so that
# recording and playback work without a person or a sound card.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         "--autoplay-policy=no-user-gesture-required")


def _find(env: str, names: tuple[str, ...]) -> str | None:
    if os.environ.get(env):
        return os.environ[env] if Path(os.environ[env]).is_file() else None
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def browser_paths() -> tuple[str | None, str | None]:
    """The Chromium and chromedriver executables ($COSYSTREAM_CHROMIUM / $COSYSTREAM_CHROMEDRIVER, else PATH)."""
    return (_find(CHROMIUM_ENV, ("chromium", "chromium-browser")),
            _find(CHROMEDRIVER_ENV, ("chromedriver",)))


def missing_browser() -> str | None:
    """Why the browser cannot run here (a sentence naming what to install), or None when it can."""
    chromium_path, driver_path = browser_paths()
    missing = [name for name, path in (("chromium", chromium_path), ("chromedriver", driver_path)) if path is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return None
    return f"headless Chromium unavailable ({', '.join(missing)} missing): {INSTALL_HINT}"


@contextmanager
def chromium(download_dir: str | Path | None = None, width: int = 1366, height: int = 900) -> Iterator[Any]:
    """A Selenium WebDriver for headless Chromium, with a throw-away profile; quits on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium_path, driver_path = browser_paths()
    if chromium_path is None or driver_path is None:
        raise RuntimeError(missing_browser())
    with tempfile.TemporaryDirectory(prefix="cosystream-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium_path
        for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        if download_dir is not None:
            options.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                                      "download.prompt_for_download": False})
        driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
        try:
            yield driver
        finally:
            driver.quit()
