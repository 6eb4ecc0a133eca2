"""The Spark platform: the session sparklm runs in (session.py), Java (java.py), the driver's Python environment
shipped to executors that lack it (environment.py), the Python workers' daemon (daemon.py) and Spark's own figures
for a block of jobs (figures.py). The rest of sparklm reaches Spark through these."""
