# `python -m sparklm`, and the file spark-submit runs (an absolute import: it is run as a script there)
from sparklm.cli import main

raise SystemExit(main())
