"""Package layout for setuptools; everything else is in pyproject.toml.

The parts of rankscope are top-level folders (trainer/, agent/, ...) imported as
``rankscope.<folder>``. This file maps each folder onto that name with ``package_dir`` and
finds its subpackages itself, so a new subfolder with an ``__init__.py`` (collector/store/,
dashboard/pages/, ...) is packaged without editing anything. A new *top-level* part is one more
entry in PARTS (and, for an editable install, one more `make install`, which reruns because
this file is newer than the install stamp).

- wheel / sdist: setuptools copies each mapped folder to ``rankscope/<folder>/``.
- editable (``pip install -e .``): setuptools installs a small import hook in site-packages
  (``__editable___rankscope_*_finder.py``) that maps ``rankscope`` to rankscope/ and each
  ``rankscope.<folder>`` to its folder here; subpackages and new modules are found through
  the package's ``__path__``, so they need no reinstall.
"""

from setuptools import find_packages, setup

PARTS = ("agent", "cli", "collector", "dashboard", "protos", "trainer")

package_dir = {"rankscope": "rankscope"}
packages = ["rankscope"]
for part in PARTS:
    name = f"rankscope.{part}"
    package_dir[name] = part
    packages.append(name)
    # Subpackages resolve through their parent's mapping (rankscope.collector.store ->
    # collector/store), so only the top-level folders need package_dir entries.
    packages += [f"{name}.{sub}" for sub in find_packages(where=part)]

setup(package_dir=package_dir, packages=packages)
