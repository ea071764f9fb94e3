// outbox console: live refresh and "select all". No library, no build step.
// A page whose <main> has data-refresh="N" is fetched again every N seconds
// and its <main> swapped in, unless the operator is typing or has ticked a
// box (a refresh must never lose what they are doing).
(function () {
  "use strict";
  var main = document.querySelector("main[data-refresh]");
  var state = document.getElementById("refresh-state");
  var toggle = document.getElementById("auto-refresh");
  function busy() {
    var a = document.activeElement;
    if (a && (a.tagName === "INPUT" || a.tagName === "TEXTAREA" || a.tagName === "SELECT")) {
      return true;
    }
    return !!document.querySelector("main input:checked");
  }
  function refresh() {
    if (busy() || (toggle && !toggle.checked)) { return; }
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Console-Refresh": "1" } })
      .then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.text();
      })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.querySelector("main");
        if (fresh && !busy()) { main.innerHTML = fresh.innerHTML; }
        if (state) { state.textContent = "updated " + new Date().toLocaleTimeString(); }
      })
      .catch(function (e) {
        if (state) { state.textContent = "refresh failed (" + e.message + "): retrying"; }
      });
  }
  if (main) {
    var secs = parseInt(main.getAttribute("data-refresh"), 10) || 5;
    window.setInterval(refresh, secs * 1000);
  }
  document.addEventListener("change", function (e) {
    var t = e.target;
    if (t && t.id === "select-all") {
      var boxes = document.querySelectorAll("input[name=id]");
      for (var i = 0; i < boxes.length; i++) { boxes[i].checked = t.checked; }
    }
  });
})();
