"""A browser for the admin and the tenant pages through Daphne: cookies kept, CSRF tokens
taken from the last page, redirects not followed."""
from __future__ import annotations

import http.cookiejar
import re
import urllib.error
import urllib.parse
import urllib.request


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


class Browser:
    """Cookies kept, redirects not followed, forms posted with the page's CSRF token."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect)
        self.page = ""

    def request(self, method: str, path: str, data: dict | None = None) -> tuple[int, dict, str]:
        body = urllib.parse.urlencode(data).encode() if data is not None else None
        request = urllib.request.Request(self.base_url + path, data=body, method=method)
        try:
            with self.opener.open(request, timeout=30) as response:
                status, headers, text = response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as error:
            status, headers, text = error.code, dict(error.headers), error.read().decode()
        if method == "GET":
            self.page = text
        return status, headers, text

    def get(self, path: str) -> tuple[int, dict, str]:
        return self.request("GET", path)

    def post(self, path: str, data: dict, csrf: bool = True) -> tuple[int, dict, str]:
        if csrf:
            data = {"csrfmiddlewaretoken": re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', self.page)[1],
                    **data}
        return self.request("POST", path, data)

    def login(self, path: str, username: str, password: str) -> None:
        self.get(path)
        status, headers, text = self.post(path, {"username": username, "password": password})
        assert status == 302, text
