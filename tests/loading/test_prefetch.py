"""The prefetch thread stops cleanly, also when its generator is closed as the interpreter exits."""

import threading

import mmfast.loading.prefetch as prefetch


def test_a_prefetcher_closed_after_module_globals_are_gone_stops_without_an_error(monkeypatch):
    """At interpreter exit a generator left mid-epoch is closed after the modules' globals were set to None: a
    CaptionLoader printed "catching classes that do not inherit from BaseException" from close()."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    it = iter(prefetch.Prefetcher(lambda: iter(range(1000)), depth=2, name="test-prefetch"))
    assert next(it) == 0
    monkeypatch.setattr(prefetch, "queue", None)  # what finalization does to the module's names
    it.close()  # the generator's finally: Prefetcher.close drains the queue and joins the producer
    assert not [t for t in threading.enumerate() if t.name == "test-prefetch"]
    assert not errors
