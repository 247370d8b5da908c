"""Download one sdist with pip's own index machinery, without building it.

``pip download --no-binary :all:`` prepares the package's metadata, which for vLLM means
installing its build requirements (a different torch); only the archive is needed here (for its
tests). Usage: ``python scripts/fetch_sdist.py NAME VERSION DEST_DIR``; prints the archive path.
Uses pip's configuration (index, certificates, proxies) and checks the index's sha256.
"""

import hashlib
import os
import sys

from pip._internal.commands import create_command
from pip._vendor.packaging.specifiers import SpecifierSet


def main() -> None:
    name, version, dest = sys.argv[1:4]
    os.makedirs(dest, exist_ok=True)
    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", f"{name}=={version}"])
    with cmd.main_context():
        fetch(cmd, options, name, version, dest)


def fetch(cmd, options, name: str, version: str, dest: str) -> None:
    session = cmd.get_default_session(options)
    finder = cmd._build_package_finder(options=options, session=session)
    best = finder.find_best_candidate(name, SpecifierSet(f"=={version}")).best_candidate
    if best is None:
        sys.exit(f"fetch_sdist: no sdist of {name}=={version} on the index")
    link = best.link
    path = os.path.join(dest, link.filename)
    if not os.path.exists(path):
        tmp = path + ".part"
        with session.get(link.url, stream=True) as r, open(tmp, "wb") as f:
            r.raise_for_status()
            for chunk in r.iter_content(1 << 20):
                f.write(chunk)
        want = link.hash if link.hash_name == "sha256" else None
        if want:
            got = hashlib.sha256(open(tmp, "rb").read()).hexdigest()
            if got != want:
                os.unlink(tmp)
                sys.exit(f"fetch_sdist: sha256 mismatch for {link.filename}")
        os.replace(tmp, path)
    print(path)


if __name__ == "__main__":
    main()
