/* Keeps the language switch pointing at the same page in the other language, with the same
   state: the query string and the hash (the comparison page keeps its state in the hash). */
(function () {
  "use strict";
  function updateLangSwitch() {
    var links = document.querySelectorAll("a[data-lang-switch]");
    for (var i = 0; i < links.length; i++) {
      var base = links[i].getAttribute("data-base-href");
      links[i].setAttribute("href", base + window.location.search + window.location.hash);
    }
  }
  window.updateLangSwitch = updateLangSwitch;
  window.addEventListener("hashchange", updateLangSwitch);
  window.addEventListener("popstate", updateLangSwitch);
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", updateLangSwitch);
  } else {
    updateLangSwitch();
  }
})();
