"""The build's one addition to pyproject.toml: the checkout's `configs/` (the draft registry, the
built-in prompt suite) copied into the package as `hf_specdec/_configs`, where an installed copy
reads them (`selection.select.registry_path`, `bench.suites.builtin_suite_path`); a checkout reads
`configs/` itself."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        shipped = Path(self.build_lib) / "hf_specdec" / "_configs"
        shutil.rmtree(shipped, ignore_errors=True)  # a build/ reused: no file removed from configs/ ships
        shutil.copytree(Path("configs"), shipped)


setup(cmdclass={"build_py": BuildPyWithConfigs})
