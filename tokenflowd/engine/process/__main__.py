"""python -m tokenflowd.engine.process '<EngineSpec as JSON>' (the supervisor's command line)."""
import sys

from tokenflowd.engine.process.loop import main

sys.exit(main())
