"""What every parity test checks before comparing two translators' outputs."""


def assert_varied(translations: list, share: float = 0.8) -> None:
  """Most nonempty translations differ from one another: two translators that both emitted
  one repeated string would agree trivially."""
  texts = [str(t) for t in translations if t]
  assert texts and len(set(texts)) >= share * len(texts), translations
